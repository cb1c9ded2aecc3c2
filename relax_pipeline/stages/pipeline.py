"""The step loop: runtime strategies drive groups through Prepare → Runtime → Reward → Transfer.

`Pipeline` owns the four stage objects and the data source and knows how to move one group through
them (`start_group`, `await_group`, `score_group`); a runtime strategy (`relax_pipeline.runtime`) decides when, and
how many groups are resident. Each rollout step ends with the dump, the metrics and the one-line
`AGENTIC ROLLOUT event=accounting_end` record. Dropped groups give their prompt back to the data
source. Training is not here: `run.py` calls the trainer between steps.
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
from relax_pipeline.stages.group import Group, drop_group
from relax_pipeline.stages.prepare import Prepare
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.runtime import Runtime
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.tracking.dump import RolloutDump
from relax_pipeline.tracking.metrics import rollout_metrics

log = logging.getLogger(__name__)


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
                 dump: RolloutDump, batch_size: int) -> None:
        self.source = source
        self.prepare = prepare
        self.runtime = runtime
        self.reward = reward
        self.transfer = transfer
        self.dump = dump
        self.batch_size = batch_size
        self.on_scored: Callable[[int], None] = lambda n: None

    async def start_group(self, rollout_id: int, mode: str = "train", *, prompt: Prompt | None = None,
                          n_samples: int | None = None, on_open: Callable[[Group], None] | None = None) -> Group:
        """Open and start a group of `prompt` (default: the data source's next) with `n_samples` sessions.

        `on_open` sees the group after its sessions exist and before its agents start (strategies attach
        the group's lease there)."""
        group = self.prepare.open_group(prompt or self.source.next(), rollout_id, mode, n_samples=n_samples)
        if on_open is not None:
            on_open(group)
        await self.prepare.start(group)
        return group

    async def await_group(self, group: Group) -> dict[str, list[Exported]]:
        """Wait for the group's agents (inside the resident capacity) and match their exports."""
        return await self.runtime.run(group)

    async def score_group(self, group: Group, exports: dict[str, list[Exported]]) -> list[dict[str, Any]]:
        """Reward and Transfer (outside the resident capacity); a dropped or filtered group returns its
        prompt to the data source."""
        await self.reward.run(group, exports)
        rows = self.transfer.run(group)
        if group.excluded and group.mode == "train":
            self.source.give_back(group.prompt)
        self.on_scored(len(group.sessions))
        return rows

    async def cancel_group(self, group: Group, reason: str) -> None:
        """Drop a group that is no longer needed: its sessions end `dropped` with `reason`, its agents are
        terminated, and scoring it later writes its dropped rows and returns its prompt."""
        drop_group(self.prepare.store, group, reason)
        await asyncio.gather(*(process.terminate() for process in group.processes.values()))

    def close_step(self, result: StepResult, started: float) -> StepResult:
        path = self.dump.write(result.rollout_id, result.rows)
        result.metrics = rollout_metrics(result.rows, result.groups, self.reward.credit.log_passrate)
        result.metrics["perf/rollout_time"] = time.time() - started
        dropped = int(result.metrics["rollout/dropped_groups"])
        filtered = int(result.metrics.get("rollout/filtered_groups", 0))
        failed = sum(1 for r in result.rows if r["status"] == "failed")
        log.info(
            "AGENTIC ROLLOUT event=accounting_end rollout=%d groups=%d rows=%d dropped=%d filtered=%d failed=%d "
            "samples=%d reward_mean=%s time_s=%.2f dump=%s",
            result.rollout_id, len(result.groups), len(result.rows), dropped, filtered, failed,
            sum(1 for r in result.rows if r["status"] in ("completed", "truncated")),
            _fmt(result.metrics.get("rollout/raw_reward")), result.metrics["perf/rollout_time"], path,
        )
        return result


def _fmt(value: float | None) -> str:
    return "nan" if value is None else f"{value:.4f}"
