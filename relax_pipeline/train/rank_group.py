"""The worker processes of a multi-rank trainer, seen from rank 0: start, command, watch, stop.

Rank 0 is the run's own process. `RankGroup.start` launches ranks 1..N-1 as `python -m
relax_pipeline.train.rank_worker` subprocesses, each in its own session (so a Ctrl-C reaches only the
run, which then stops them) with the launcher variables (RANK, LOCAL_RANK = RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), stdout and stderr in `<log_dir>/rank<r>.log`, and one end of a socket pair as its control
channel (fd number in RELAX_RANK_FD). Over the channel rank 0 sends pickled `(command, args)` tuples
(the trainer's constructor settings, each rank's `RankShare`s, checkpoint folders) and each worker answers
`("ok", None)` or `("error", traceback)`; tensors travel only through torch.distributed collectives.

Failure: a worker that raises, exits or is killed closes its end of the channel, so rank 0 sees it at
once (`collect`), and a collective rank 0 is blocked in fails when the peer's gloo connection drops;
either way the trainer raises `RankFailed` naming the rank, its exit code, its log and the log's last
lines. Orphans: a worker exits when its channel reaches end-of-file or its parent process changes (rank 0
died, even by SIGKILL; rank_worker.py), and `close` asks each worker to stop, then terminates and kills
their process groups.

What this module does not do: DeepSpeed, process groups or samples (deepspeed_backend.py); ranks on
other hosts (one machine: LOCAL_RANK = RANK).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import relax_pipeline
from relax_pipeline.infra.processes import signal_group

WORKER_MODULE = "relax_pipeline.train.rank_worker"
FD_ENV = "RELAX_RANK_FD"
"""Environment variable holding the worker's control-channel file descriptor."""
PARENT_ENV = "RELAX_RANK_PARENT"
"""Environment variable holding rank 0's pid; a worker whose parent changes exits."""
STARTUP_TIMEOUT_S = 600.0
"""How long rank 0 waits for a worker to import torch and DeepSpeed and say it is ready."""
STOP_GRACE_S = 10.0
"""How long `close` waits for a worker to stop by itself before SIGTERM, then as long again before SIGKILL."""
LOG_TAIL_LINES = 20
COMMANDS = {"train": "run_shares", "gather": "gathered_weights", "save": "save_part", "load": "load"}
"""Rank 0's command → the `WorkerTrainer` method every worker runs for it (the same collectives as rank 0)."""


class RankFailed(RuntimeError):
    """A trainer rank process raised, exited or was killed; the message names the rank, exit code and log."""


@dataclass
class Worker:
    """One worker rank as rank 0 holds it."""

    rank: int
    process: subprocess.Popen[bytes]
    conn: Connection
    log: Path


class RankGroup:
    """Ranks 1..N-1 of a trainer; rank 0 sends every rank the same command and waits for all of them."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.failed: str | None = None
        """The first failure seen (a `RankFailed` message); later commands fail with it at once."""

    @classmethod
    def start(cls, world: int, settings: tuple[Any, Any], log_dir: Path) -> RankGroup:
        """Launch ranks 1..world-1 (inheriting rank 0's environment: MASTER_ADDR, MASTER_PORT, ...) and send
        each the trainer `settings`; return once every worker has imported its libraries and is about to
        join the process group."""
        log_dir.mkdir(parents=True, exist_ok=True)
        group = cls([])
        try:
            for rank in range(1, world):
                group.workers.append(_launch(rank, world, log_dir))
            group.send("init", settings)
            group.collect("start-up", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            group.close()
            raise
        return group

    def send(self, command: str, *args: Any, per_rank: Sequence[Any] | None = None) -> None:
        """Send `(command, args)` to every worker; `per_rank[r - 1]` is appended to worker r's args."""
        self._raise_if_failed()
        for w in self.workers:
            extra = () if per_rank is None else (per_rank[w.rank - 1],)
            try:
                w.conn.send((command, (*args, *extra)))
            except OSError:
                self._fail(w, command)

    def collect(self, command: str, timeout: float | None = None) -> None:
        """Wait until every worker answered the last command; `RankFailed` when one raised or died."""
        pending = {w.conn: w for w in self.workers}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                worker = next(iter(pending.values()))
                self._fail(worker, command, f"no answer within {timeout:.0f} s")
            for conn in wait(list(pending), timeout=1.0):
                worker = pending.pop(conn)  # type: ignore[arg-type]
                self._answer(worker, command)

    def _answer(self, worker: Worker, command: str) -> None:
        """Read one answer of `worker`: "ok" returns; an error, or the channel closing, raises `RankFailed`."""
        try:
            status, detail = worker.conn.recv()
        except (EOFError, OSError):
            status, detail = "gone", None
        if status != "ok":
            self._fail(worker, command, None if detail is None else str(detail))

    def diagnose(self, command: str, grace_s: float = 5.0) -> None:
        """After a collective failed on rank 0: raise `RankFailed` for the worker that died or raised (waiting
        up to `grace_s` for it to show); return when every worker still looks healthy."""
        self._raise_if_failed()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for conn in wait([w.conn for w in self.workers], timeout=0.2):
                worker = next(w for w in self.workers if w.conn is conn)
                self._answer(worker, command)

    def _fail(self, worker: Worker, command: str, detail: str | None = None) -> None:
        """Record and raise the failure of `worker` during `command`."""
        code = _exit_code(worker.process)
        how = f"exited with code {code}" if code is not None else "stopped answering"
        self.failed = (f"trainer rank {worker.rank} (pid {worker.process.pid}) {how} during {command!r}"
                       + (f": {detail.strip().splitlines()[-1]}" if detail else "")
                       + f"; its log: {worker.log}\n--- last lines of {worker.log} ---\n{_tail(worker.log)}")
        raise RankFailed(self.failed)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise RankFailed(self.failed)

    def close(self) -> None:
        """Ask every worker to stop, then SIGTERM and SIGKILL the process groups of those still running."""
        for w in self.workers:
            try:
                w.conn.send(("close", ()))
            except OSError:
                pass
        _stop([w.process for w in self.workers], STOP_GRACE_S)
        for w in self.workers:
            w.conn.close()


def _launch(rank: int, world: int, log_dir: Path) -> Worker:
    """Start worker `rank` with its end of a fresh socket pair."""
    ours, theirs = socket.socketpair()
    log = log_dir / f"rank{rank}.log"
    child_env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                 FD_ENV: str(theirs.fileno()), PARENT_ENV: str(os.getpid()), "PYTHONPATH": _python_path()}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=child_env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                                   start_new_session=True)
    theirs.close()
    return Worker(rank, process, Connection(ours.detach()), log)


def _python_path() -> str:
    """This package's parent first, so a worker imports the same relax_pipeline as rank 0."""
    root = str(Path(relax_pipeline.__file__).resolve().parent.parent)
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def _stop(processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Wait `grace_s` for each process, then SIGTERM its process group, then SIGKILL it."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        running = [p for p in processes if p.poll() is None]
        for p in running:
            if sig is not None:
                signal_group(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while running and time.monotonic() < deadline:
            running = [p for p in running if p.poll() is None]
            time.sleep(0.05)
        if not running:
            return


def _exit_code(process: subprocess.Popen[bytes], wait_s: float = 5.0) -> int | None:
    """The exit code once the process ended (waiting up to `wait_s`: its channel closes just before it exits)."""
    try:
        return process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError as err:
        return f"(unreadable: {err})"
    return "\n".join(lines[-LOG_TAIL_LINES:])
