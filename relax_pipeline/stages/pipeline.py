"""One group through the four stages: Prepare → Runtime → Reward → Transfer, and the close of a step.

`Pipeline` owns the four stage objects, the data source and the rollout dump, and moves one group through
them (`start_group`, `await_group`, `score_group`); it does not decide when or how many: a runtime strategy
(`relax_pipeline.scheduling`) calls these methods and keeps groups resident under the capacity. A dropped
or filtered train group gives its prompt back to the data source. `close_step` ends a rollout step: it
writes the dump, takes the rollout metrics (`rollout/wasted_tokens`: tokens of filtered or surplus groups; the
user's `credit.metrics_path` hook's `rollout/user/*`) and logs the one-line `AGENTIC ROLLOUT event=accounting_end`
record. Training, weight sync and checkpoints
are not here: the step loop (`loop.py`) calls the trainer between steps.

The pipeline knows which groups still have agents running (started, not yet through `await_group`).
`interrupt(reason)` (the run's first SIGINT/SIGTERM) drops every one of them (`cancel_group`: sessions
recorded `dropped` with the reason and the outcome `interrupted`, agents terminated) and sets `stopped`, after
which strategies and the evaluator start no group; `kill_agents` is the second signal's last resort (SIGKILL or
DELETE, no bookkeeping).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.data.dataset import DataSource, Prompt
from relax_pipeline.forest.export import Exported
from relax_pipeline.stages.group import ABORTED, INTERRUPTED, OUTCOMES, Group, drop_group
from relax_pipeline.stages.prepare import Prepare
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.runtime import Runtime
from relax_pipeline.stages.settings import RolloutSettings
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.tracking.dump import RolloutDump
from relax_pipeline.tracking.metrics import generated_tokens, rollout_metrics
from relax_pipeline.turn.sessions import Session

log = logging.getLogger(__name__)
SURPLUS = "surplus: the step already had rollout.batch_size groups"
"""Why a group still running when its step had its groups is dropped (its generation counts as wasted)."""


@dataclass
class StepResult:
    """What one rollout step produced; connects the step loop to the trainer and the tracker."""

    rollout_id: int
    groups: list[Group] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class Pipeline:
    """Stage objects plus the data source; strategies call its group methods."""

    def __init__(self, source: DataSource, prepare: Prepare, runtime: Runtime, reward: Reward, transfer: Transfer,
                 dump: RolloutDump, rollout: RolloutSettings) -> None:
        self.source = source
        self.prepare = prepare
        self.runtime = runtime
        self.reward = reward
        self.transfer = transfer
        self.dump = dump
        self.batch_size = rollout.batch_size
        """`rollout.batch_size`: groups a step closes with."""
        self.on_scored: Callable[[int], None] = lambda n: None
        self.stopped: str | None = None
        """Why the run is stopping (`interrupt`); no group starts once it is set."""
        self._running: dict[int, Group] = {}
        """Groups whose agents may still run (started, not yet through `await_group`), by id()."""
        self._cancels: set[asyncio.Task[None]] = set()
        self._reward_s = 0.0
        """Seconds spent scoring groups since the step started (`perf/reward_s`)."""

    @property
    def whole_groups(self) -> bool:
        """Whether a group's sessions run as one runtime group (the credit needs the whole group before scoring:
        `credit=group_rm`), else one runtime group per session (`stages.group.runtime_groups`)."""
        return self.reward.credit.whole_groups

    async def start_group(self, rollout_id: int, mode: str = "train", *, prompt: Prompt | None = None,
                          n_samples: int | None = None, on_open: Callable[[Group], None] | None = None) -> Group:
        """Open and start a group of `prompt` (default: the data source's next) with `n_samples` sessions.

        `on_open` sees the group after its sessions exist and before its agents start (strategies attach
        the group's lease there)."""
        group = self.prepare.open_group(prompt or self.source.next(), rollout_id, mode, n_samples=n_samples)
        if on_open is not None:
            on_open(group)
        self._running[id(group)] = group
        try:
            await self.prepare.start(group)
        except BaseException:
            self._running.pop(id(group), None)
            raise
        return group

    async def await_group(self, group: Group, on_session_end: Callable[[Session], None] | None = None
                          ) -> dict[str, list[Exported]]:
        """Wait for the group's agents (inside the resident capacity) and match their exports; `on_session_end`
        sees each session as its agent is done (the pool frees its agent slot there)."""
        try:
            return await self.runtime.run(group, on_session_end)
        finally:
            self._running.pop(id(group), None)

    async def score_group(self, group: Group, exports: dict[str, list[Exported]]) -> list[dict[str, Any]]:
        """Reward and Transfer (outside the resident capacity); a dropped or filtered group returns its
        prompt to the data source."""
        started = time.perf_counter()
        await self.reward.run(group, exports)
        self._reward_s += time.perf_counter() - started
        rows = self.transfer.run(group)
        if group.excluded and group.mode == "train":
            self.source.give_back(group.prompt)
        self.on_scored(len(group.sessions))
        return rows

    async def cancel_group(self, group: Group, reason: str, outcome: str = ABORTED) -> None:
        """Drop a group that is no longer needed: its sessions end `dropped` with `reason` and `outcome`, its
        agents are terminated, and scoring it later writes its dropped rows and returns its prompt."""
        drop_group(self.prepare.store, group, reason, outcome=outcome)
        await asyncio.gather(*(process.terminate() for process in group.processes.values()))

    def interrupt(self, reason: str) -> int:
        """Stop: start no more groups, drop every group whose agents still run; returns how many."""
        self.stopped = reason
        for group in list(self._running.values()):
            task = asyncio.ensure_future(self.cancel_group(group, reason, INTERRUPTED))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
        return len(self._running)

    def kill_agents(self) -> None:
        """End every agent still running at once (the second signal: no waiting): SIGKILL a local process
        group, one DELETE for a session on an agent server."""
        for group in list(self._running.values()):
            for process in group.processes.values():
                process.kill()

    async def close_step(self, result: StepResult, started: float) -> StepResult:
        path = self.dump.write(result.rollout_id, result.rows)
        result.metrics = rollout_metrics(result.rows, result.groups, self.reward.credit.log_passrate)
        result.metrics.update(await self.reward.credit.user_metrics(result.rows))
        for outcome in OUTCOMES:
            result.metrics.setdefault(f"rollout/outcome/{outcome}", 0.0)
        wasted = [g for g in result.groups if g.filtered or g.dropped == SURPLUS]
        result.metrics["rollout/wasted_tokens"] = float(generated_tokens(wasted))
        result.metrics["perf/rollout_time"] = time.time() - started
        result.metrics["perf/reward_s"], self._reward_s = self._reward_s, 0.0
        dropped = int(result.metrics["rollout/dropped_groups"])
        filtered = int(result.metrics.get("rollout/filtered_groups", 0))
        failed = sum(1 for r in result.rows if r["status"] == "failed")
        scored = [r for r in result.rows if r["status"] in ("completed", "truncated")]
        credited = sum(1 for r in scored if r["advantage"] is not None)
        log.info(
            "AGENTIC ROLLOUT event=accounting_end rollout=%d groups=%d rows=%d dropped=%d filtered=%d failed=%d "
            "samples=%d uncredited=%d reward_mean=%s time_s=%.2f dump=%s",
            result.rollout_id, len(result.groups), len(result.rows), dropped, filtered, failed, credited,
            len(scored) - credited, _fmt(result.metrics.get("rollout/raw_reward")), result.metrics["perf/rollout_time"],
            path,
        )
        self.release(result.groups)
        return result

    def release(self, groups: list[Group]) -> None:
        """Rows written, metrics taken: the store forgets these groups' ended sessions (`ForestStore.release`)."""
        for group in groups:
            for session in group.sessions:
                self.prepare.store.release(session)


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4f}"
