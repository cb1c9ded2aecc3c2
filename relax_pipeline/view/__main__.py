"""`python -m relax_pipeline.view OUTPUT_DIR [--port N] [--host H] [--tokenizer FOLDER]`: serve the run viewer.

The same as `python -m relax_pipeline job=view view.dir=OUTPUT_DIR`, without composing a config. Serves
until Ctrl-C; `--port 0` picks a free port (the first log line gives the URL).
"""

from __future__ import annotations

import argparse
import sys

from relax_pipeline.view.server import serve_view


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_pipeline.view", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a run's output folder (run.log, config.yaml, the rollout dump, metrics.jsonl)")
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default 127.0.0.1: this machine)")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    parser.add_argument("--tokenizer", default=None, help="Hugging Face folder to decode tokens with "
                        "(default: the run's newest checkpoint, else its model)")
    args = parser.parse_args(argv)
    try:
        serve_view(args.dir, args.host, args.port, args.tokenizer)
    except (FileNotFoundError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
