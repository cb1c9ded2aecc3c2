"""`python -m relax_pipeline [overrides]`: compose the config with Hydra and call `run(cfg)`.

One convenience before Hydra parses the command line: an override whose value holds a `{rollout_id}`
placeholder (`debug.save_rollout_data=out/r_{rollout_id}.jsonl`) is quoted, since Hydra's grammar
reads a bare `{` as the start of a dict. Exit status: 0; 1 when the run failed (`run` said why in one
sentence, `run failed: ...`, the last line of stderr and of run.log when the job writes one; no traceback);
130/143 when a SIGINT/SIGTERM stopped it (its last log line says where the checkpoint is). `job=check`
exits with its certificate's verdict (`certify/certificate.py`): 0 training-grade, 1 degraded, 2 broken (a
check that cannot even start, such as a config that names a parser that does not exist, is broken too).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from relax_pipeline.config import quote_placeholders, register
from relax_pipeline.loop import RunInterrupted
from relax_pipeline.run import run

BROKEN = 2
"""`job=check`'s exit status for a broken app (`certify.certificate.EXIT_STATUS`)."""

register()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        metrics = run(cfg)
    except RunInterrupted as stop:  # run() already logged where the checkpoint is and how to resume
        sys.exit(stop.exit_code)
    except Exception:  # noqa: BLE001 - run() already said why in one sentence (run.log and stderr, or stderr only)
        sys.exit(BROKEN if cfg.job == "check" else 1)
    if cfg.job == "check":
        sys.exit(int(metrics["check/exit_status"]))


if __name__ == "__main__":
    sys.argv = quote_placeholders(sys.argv)
    main()
