"""A worker rank (1..N-1) of `trainer=deepspeed trainer.num_ranks=N`: `python -m relax_pipeline.train.rank_worker`.

Started by rank 0's `RankGroup` (rank_group.py) with the launcher variables set and a control channel on
the file descriptor in RELAX_RANK_FD. It receives the trainer's settings, answers "ready" once torch and
DeepSpeed are imported, builds a `WorkerTrainer` (the same DeepSpeed engine, joining rank 0's process
group), answers "ok", and then runs each command rank 0 sends (`COMMANDS`: its share of a training step,
its part of a ZeRO-3 gather, a checkpoint save or load) in the same order as rank 0, answering "ok" after
each, until "close" or end-of-file. Any exception is printed to the log, sent to rank 0 as
`("error", traceback)`, and ends the process with code 1. A watchdog thread exits the process when its
parent changes (rank 0 died without closing the channel).

What it does not do: choose its share of the data, write the Hugging Face weights or the trainer state
(rank 0 does), or outlive rank 0.
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from relax_pipeline.infra.processes import exit_when_orphaned
from relax_pipeline.train.rank_group import COMMANDS, FD_ENV, PARENT_ENV


def main() -> int:
    """Serve rank 0 until it says "close" or goes away; 0 on a clean stop, 1 after an error."""
    fd = int(os.environ[FD_ENV])
    os.set_inheritable(fd, False)
    conn = Connection(fd)
    exit_when_orphaned(int(os.environ[PARENT_ENV]))
    try:
        serve(conn)
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        _send(conn, ("error", text))
        return 1
    return 0


def serve(conn: Connection) -> None:
    """Build the trainer from rank 0's settings, then run its commands in order."""
    command, (settings,) = conn.recv()
    if command != "init":
        raise RuntimeError(f"rank worker expected 'init' first, got {command!r}")
    trainer = _trainer(settings, conn)
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            trainer.close()
            return
        if command == "close":
            trainer.close()
            return
        getattr(trainer, COMMANDS[command])(*args)
        conn.send(("ok", None))


def _trainer(settings: tuple[Any, Any], conn: Connection) -> Any:
    """Import DeepSpeed, say "ready" (rank 0 then joins the group too), build the rank's trainer."""
    import deepspeed  # noqa: F401 - the slow import happens before "ready"

    from relax_pipeline.train.deepspeed_backend import WorkerTrainer

    conn.send(("ok", None))
    trainer = WorkerTrainer(*settings)
    conn.send(("ok", None))
    return trainer


def _send(conn: Connection, message: tuple[str, str]) -> None:
    try:
        conn.send(message)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
