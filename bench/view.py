"""The run viewer on a big step: how long a folder with thousands of sessions takes to open, side by side with
reading the dump naively.

Writes a synthetic run folder (`relax_pipeline.testing.run_folders`: `--sessions` sessions in one step, every
4th forked into two chains, `--response` generated tokens per row, real dump key order), starts the viewer
(uvicorn on 127.0.0.1:0) and measures over HTTP what the page fetches when it opens the step: `/api/run`,
`/api/metrics` and the first page of sessions (cold: the step's index is built), then another page and a
status filter (warm), then two forked sessions (the first waits for the tokenizer to load). Beside it, the
naive reader: `json.loads` of every row of the same file (what a viewer without the head-only index would
do before showing anything). Printed: each time, the file size and the ratio naive / ours for the cold
open. The issue's target: under 2 s to open.

    python bench/view.py [--sessions 5000] [--response 1000] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx
from _smoke import parse_args

from relax_pipeline.testing.run_folders import write_run_folder
from relax_pipeline.view.server import ViewServer


def timed(http: httpx.Client, *paths: str) -> float:
    start = time.perf_counter()
    for path in paths:
        http.get(path).raise_for_status()
    return time.perf_counter() - start


def naive(path: Path) -> float:
    start = time.perf_counter()
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert rows
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    parser.add_argument("--response", type=int, default=1000, help="generated tokens per row")
    args = parse_args(parser, sessions=16, response=16)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folder = write_run_folder(Path(tmp), steps=1, sessions=args.sessions, fork_every=4, fail_every=50,
                                  response=args.response)
        dump = folder / "dump" / "rollout_0.jsonl"
        print(f"wrote {args.sessions} sessions, {dump.stat().st_size / 2**20:.1f} MiB in "
              f"{time.perf_counter() - start:.1f}s")
        server = ViewServer(folder).start()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            cold = timed(http, "/api/run", "/api/metrics", "/api/steps/0/sessions?limit=50")
            warm = timed(http, "/api/steps/0/sessions?limit=50&offset=2500")
            filtered = timed(http, "/api/steps/0/sessions?status=failed")
            first = timed(http, "/api/steps/0/sessions/sess-0-2")  # loads the tokenizer (transformers import)
            session = timed(http, "/api/steps/0/sessions/sess-0-6")
        server.stop()
        baseline = naive(dump)
    print(f"open the step (run + metrics + first page, index built): {cold * 1000:.0f} ms (target < 2000 ms)")
    print(f"another page: {warm * 1000:.1f} ms; status filter: {filtered * 1000:.1f} ms; "
          f"first session opened (tokenizer loaded): {first * 1000:.0f} ms; "
          f"another forked session with tokens: {session * 1000:.1f} ms")
    print(f"naive json.loads of every row: {baseline * 1000:.0f} ms; naive / ours (cold open) = {baseline / cold:.2f}x")


if __name__ == "__main__":
    main()
