"""Worker ranks on a Ray cluster (`trainer.rank_placement=ray`): ranks 1..N-1 as Ray actors on any of its nodes.

`RayRankGroup` is `RankGroup` (rank_group.py) for ranks that live on other machines: rank 0 (the run's process)
starts one `RankActor` per worker rank with `trainer.rank_resources` (`{num_gpus: 1}` on GPU nodes; Ray then sets
the actor's CUDA_VISIBLE_DEVICES, so its LOCAL_RANK is 0), sets the launcher variables in each (RANK, WORLD_SIZE,
MASTER_ADDR = rank 0's address on the cluster, MASTER_PORT) and drives them with the same commands as local
workers (`rank_group.COMMANDS`), one Ray call each: the call's arguments (settings, each rank's `RankShare`s)
travel through Ray, tensors only through torch.distributed (gloo on CPU, NCCL on GPUs). So the trainer's step,
checkpoint and weight gathering are the same code as with local ranks; `send` starts the ranks' calls and `collect`
waits for them while rank 0 runs its own part in between.

Failure: a rank whose call raises fails it with `RankFailed` naming the rank, its node and the error's last line;
a rank whose actor or node died fails it the same way ("died"). Each actor writes its output to
`<node temp folder>/relax-trainer-rank-*/rank<r>.log` on its node; a failure's message carries its last lines
while the actor lives, and `close` moves it to rank 0's `<output>/trainer_ranks/rank<r>.log`. Actors are owned by
rank 0: they end when it closes the group or exits, even by SIGKILL (Ray ends an owner's actors).

Needs: the model path and the checkpoint folder readable and writable at the same path on every node that holds a
rank (a shared filesystem), and rank 0's address reachable from them (set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
through `ray.runtime_env.env_vars` when a node has several interfaces). Not done here: elastic ranks, restarting a
lost rank (the step fails, like a local worker's death).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from relax_pipeline.infra import ray_runtime
from relax_pipeline.train.rank_group import COMMANDS, LOG_TAIL_LINES, STARTUP_TIMEOUT_S, RankFailed

log = logging.getLogger("relax_pipeline")

LOG_FOLDER = "relax-trainer-rank"
"""The prefix of the folder (under its node's temp folder) each rank logs into."""
LOG_COPY_BYTES = 16 << 20
"""How much of the end of each rank's log `close` copies to rank 0's log folder."""
DEFAULT_RESOURCES = {"num_cpus": 1}
"""What one rank holds when `trainer.rank_resources` is empty (`{num_gpus: 1}` is the usual choice on GPUs)."""


class RankActor:
    """One worker rank, living in a Ray actor process (see the module)."""

    def __init__(self, rank: int, launch: Mapping[str, str]) -> None:
        self.rank = rank
        self.log = Path(tempfile.mkdtemp(prefix=f"{LOG_FOLDER}-")) / f"rank{rank}.log"
        with open(self.log, "ab") as log:  # the rank's prints, warnings and tracebacks
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        os.environ.update(launch)
        self.trainer: Any = None

    def ready(self) -> str:
        """Import DeepSpeed (the slow part of a start); this rank's node, `host (node id)`."""
        import deepspeed  # noqa: F401

        return f"{ray_runtime.node_ip()} ({ray_runtime.import_ray().get_runtime_context().get_node_id()[:12]})"

    def build(self, worker_class: type, settings: tuple[Any, Any]) -> None:
        """Join rank 0's process group and build the rank's trainer, `worker_class(*settings)` (deepspeed_backend's
        `WorkerTrainer`: its construction runs collectives with rank 0's)."""
        self.trainer = self._logged(worker_class, *settings)

    def call(self, command: str, args: tuple[Any, ...]) -> None:
        """Run rank 0's `command` (`rank_group.COMMANDS`) with `args`."""
        self._logged(getattr(self.trainer, COMMANDS[command]), *args)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    def tail(self) -> str:
        """The last lines of this rank's log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])

    def log_path(self) -> str:
        return str(self.log)

    def log_text(self, limit: int, remove: bool = False) -> bytes:
        """The last `limit` bytes of this rank's log; `remove`: then delete its folder (the log was copied)."""
        with open(self.log, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - limit))
            text = log.read()
        if remove:
            shutil.rmtree(self.log.parent, ignore_errors=True)
        return text

    def _logged(self, work: Any, *args: Any, **kwargs: Any) -> Any:
        """`work(...)`; on an exception the traceback goes to the log, the rank leaves the process group (closing
        its connections, so rank 0 is not left waiting in a collective for it), and the error goes up to rank 0."""
        try:
            return work(*args, **kwargs)
        except BaseException:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            self._leave_group()
            raise

    def _leave_group(self) -> None:
        import torch.distributed

        try:
            self.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:  # leaving is best effort; a local rank would have exited
            print(traceback.format_exc(), file=sys.stderr, flush=True)


class RayRankGroup:
    """Ranks 1..N-1 as Ray actors; the interface of `RankGroup` (send, collect, diagnose, close)."""

    def __init__(self, ray: Any, log_dir: Path | None = None) -> None:
        self.ray = ray
        self.log_dir = log_dir
        """Where `close` copies each rank's log (`rank<r>.log`, as local ranks write theirs); None: not copied."""
        self.actors: list[Any] = []
        self.nodes: list[str] = []
        self.failed: str | None = None
        """The first failure seen (a `RankFailed` message); later commands fail with it at once."""
        self._pending: list[Any] = []

    @classmethod
    def start(cls, world: int, worker_class: type, settings: tuple[Any, Any], resources: Mapping[str, float],
              ray_settings: Mapping[str, Any] | None, log_dir: Path | None = None) -> RayRankGroup:
        """Start ranks 1..world-1 on the cluster with rank 0's launcher variables, wait until each has imported
        DeepSpeed, then start their builds: rank 0 builds its own part next, and `collect("start-up")` waits."""
        group = cls(ray_runtime.connect(ray_settings), log_dir)
        try:
            remote = group.ray.remote(RankActor)
            options = _actor_options(resources or DEFAULT_RESOURCES)
            for rank in range(1, world):
                group.actors.append(remote.options(**options).remote(rank, _launch_variables(rank)))
            group._pending = [actor.ready.remote() for actor in group.actors]
            group.nodes = [str(node) for node in group._wait("start-up", STARTUP_TIMEOUT_S)]
            log.info("trainer ranks: %s", ", ".join(f"rank {r} on node {n}" for r, n in enumerate(group.nodes, 1)))
            group._pending = [actor.build.remote(worker_class, settings) for actor in group.actors]
        except BaseException:
            group.close()
            raise
        return group

    def send(self, command: str, *args: Any, per_rank: Sequence[Any] | None = None) -> None:
        """Start `command` on every rank; `per_rank[r - 1]` is appended to rank r's args."""
        self._raise_if_failed()
        self._pending = [actor.call.remote(command, (*args, *(() if per_rank is None else (per_rank[i],))))
                         for i, actor in enumerate(self.actors)]

    def collect(self, command: str, timeout: float | None = None) -> None:
        """Wait until every rank finished the last command; `RankFailed` when one raised or died."""
        self._wait(command, timeout)

    def diagnose(self, command: str, grace_s: float = 5.0) -> None:
        """After a collective failed on rank 0: raise `RankFailed` for the rank that failed (waiting up to
        `grace_s` for it to show); return when every rank still looks healthy."""
        self._raise_if_failed()
        done, _ = self.ray.wait(self._pending, num_returns=len(self._pending), timeout=grace_s)
        for ref in done:
            self._result(self._pending.index(ref), ref, command)

    def close(self) -> None:
        """Let every rank close its trainer (a few seconds at most), then end the actors; nothing to do once Ray
        is gone (its actors went with it)."""
        actors, self.actors, self._pending = self.actors, [], []
        if not actors or not self.ray.is_initialized():
            return
        if self.failed is None:
            closing = [actor.close.remote() for actor in actors]
            self.ray.wait(closing, num_returns=len(closing), timeout=10.0)
        self._copy_logs(actors)
        for actor in actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone with its node
                pass

    def _copy_logs(self, actors: list[Any]) -> None:
        """Each living rank's log into `log_dir/rank<r>.log` (best effort: a lost rank's log stays on its node)."""
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank, actor in enumerate(actors, 1):
            try:
                (self.log_dir / f"rank{rank}.log").write_bytes(
                    self.ray.get(actor.log_text.remote(LOG_COPY_BYTES, remove=True), timeout=10.0))
            except Exception as error:  # the actor or its node is gone
                log.warning("trainer ranks: could not copy rank %d's log (%s)", rank, type(error).__name__)

    def _wait(self, command: str, timeout: float | None) -> list[Any]:
        """Every rank's result of the last command, in rank order; the first rank that fails raises at once (the
        others may be blocked in a collective with it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = {ref: index for index, ref in enumerate(self._pending)}
        results: list[Any] = [None] * len(self._pending)
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = self.ray.wait(list(waiting), num_returns=1, timeout=left)
            if not done:
                self._fail(min(waiting.values()), command, f"no answer within {timeout:.0f} s")
            for ref in done:
                index = waiting.pop(ref)
                results[index] = self._result(index, ref, command)
        return results

    def _result(self, index: int, ref: Any, command: str) -> Any:
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as error:
            self._fail(index, command, str(error.cause if error.cause is not None else error))
        except self.ray.exceptions.RayActorError as error:
            self._fail(index, command, None, died=f"{type(error).__name__}")

    def _fail(self, index: int, command: str, detail: str | None, died: str | None = None) -> None:
        """Record and raise the failure of worker rank `index + 1` during `command`."""
        actor, rank = self.actors[index], index + 1
        node = self.nodes[index] if index < len(self.nodes) else "(not placed yet)"
        how = f"died ({died})" if died else "raised" if detail else "stopped answering"
        try:
            log, tail = self.ray.get([actor.log_path.remote(), actor.tail.remote()], timeout=10.0)
        except Exception:
            log, tail = f"{LOG_FOLDER}-*/rank{rank}.log in the temp folder of node {node}", "(the rank is gone)"
        last = detail.strip().splitlines()[-1] if detail and detail.strip() else ""
        self.failed = (f"trainer rank {rank} (Ray actor on node {node}) {how} during {command!r}"
                       + (f": {last}" if last else "") + f"; its log on that node: {log}\n"
                       f"--- last lines of {log} ---\n{tail}")
        raise RankFailed(self.failed)

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise RankFailed(self.failed)


def _launch_variables(rank: int) -> dict[str, str]:
    """The variables a rank's process needs, from rank 0's environment (set by `prepare_environment`)."""
    keys = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
    return {**{k: os.environ[k] for k in keys if k in os.environ}, "RANK": str(rank), "LOCAL_RANK": "0"}


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options for one rank: `num_cpus`, `num_gpus`, `memory` as they are, other keys as custom
    resources; one restart never (a rank's state cannot be rebuilt)."""
    builtin = {k: v for k, v in resources.items() if k in ("num_cpus", "num_gpus", "memory")}
    custom = {k: v for k, v in resources.items() if k not in builtin}
    return {**builtin, **({"resources": custom} if custom else {}), "max_restarts": 0, "max_concurrency": 2}
