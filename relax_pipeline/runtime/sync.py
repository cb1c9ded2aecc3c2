"""`runtime=sync`: each step runs groups under the resident capacity until it has `rollout.batch_size`.

Up to `rollout.over_sampling_batch_size` groups (default `rollout.batch_size`; at most the resident
capacity at a time) start at once. Groups finish their agents inside the capacity and are scored
outside it, one by one as they come in: a group that is dropped (a session failed) or filtered (its
credit or `credit.filter_path` rejected it) is replaced by a new group within the step, up to
`MAX_STARTS_PER_NEED` starts per needed group, after which the step ends short and says so. Once the step
has its groups, the groups still running are surplus: their agents are terminated and their sessions
recorded as dropped ("surplus"), and their prompts go back to the data source like every excluded
group's, so an epoch still covers every prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from relax_pipeline.forest.export import Exported
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline, StepResult

log = logging.getLogger(__name__)
MAX_STARTS_PER_NEED = 4
SURPLUS = "surplus: the step already had rollout.batch_size groups"


@dataclass
class _Step:
    """The groups of one step in flight; connects the task callbacks to the step's result."""

    pipeline: Pipeline
    rollout_id: int
    slots: asyncio.Semaphore
    running: dict[asyncio.Task, Group | None] = field(default_factory=dict)
    closing: bool = False
    starts: int = 0

    def start(self) -> None:
        task = asyncio.ensure_future(self._one())
        self.running[task] = None
        self.starts += 1

    async def _one(self) -> tuple[Group, dict[str, list[Exported]]] | None:
        async with self.slots:
            if self.closing:
                return None
            group = await self.pipeline.start_group(self.rollout_id)
            self.running[asyncio.current_task()] = group
            return group, await self.pipeline.await_group(group)


class SyncRuntime:
    """The baseline strategy; later modes reuse its knobs and the `Pipeline` group methods."""

    def __init__(self, concurrency: int | None = None, eval_concurrency: int | None = None,
                 max_aborted_count: int = 2) -> None:
        self.concurrency = concurrency
        self.eval_concurrency = eval_concurrency
        self.max_aborted_count = max_aborted_count
        self.capacity = concurrency or 1
        self.over_sampling: int | None = None

    def bind(self, capacity: int, over_sampling: int | None = None) -> None:
        """Set the resident capacity the run resolved (see `runtime.base.resident_capacity`)."""
        self.capacity = capacity
        self.over_sampling = over_sampling

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        started, need = time.time(), pipeline.batch_size
        pipeline.source.new_step()
        step = _Step(pipeline, rollout_id, asyncio.Semaphore(self.capacity))
        result = StepResult(rollout_id)
        for _ in range(max(need, self.over_sampling or need)):
            step.start()
        accepted = await self._collect(step, result, need)
        if accepted < need:
            log.warning("rollout %d: only %d of %d groups after %d starts (every other group was dropped or "
                        "filtered); the step goes on short", rollout_id, accepted, need, step.starts)
        await self._close(step, result)
        result.groups.sort(key=lambda g: g.id)
        return pipeline.close_step(result, started)

    async def _collect(self, step: _Step, result: StepResult, need: int) -> int:
        accepted = 0
        while accepted < need and step.running:
            done, _ = await asyncio.wait(list(step.running), return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step.running.pop(task)
                outcome = task.result()
                if outcome is None:
                    continue
                if accepted >= need:
                    await step.pipeline.cancel_group(outcome[0], SURPLUS)
                accepted += await self._score(step, result, *outcome)
                if accepted + len(step.running) < need and step.starts < MAX_STARTS_PER_NEED * need:
                    step.start()
        return accepted

    @staticmethod
    async def _score(step: _Step, result: StepResult, group: Group, exports: dict[str, list[Exported]]) -> int:
        result.groups.append(group)
        result.rows.extend(await step.pipeline.score_group(group, exports))
        return 0 if group.excluded else 1

    async def _close(self, step: _Step, result: StepResult) -> None:
        """Terminate surplus groups and record them; groups that never started are just cancelled."""
        step.closing = True
        await asyncio.gather(*(step.pipeline.cancel_group(g, SURPLUS) for g in step.running.values() if g))
        for outcome in await asyncio.gather(*step.running):
            if outcome is not None:
                await self._score(step, result, *outcome)

    async def before_weight_update(self) -> None:
        return None

    async def close(self) -> None:
        return None
