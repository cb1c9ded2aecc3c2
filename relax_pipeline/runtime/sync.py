"""`runtime=sync`: each step starts its groups under the resident capacity and waits for all of them.

At most `runtime.concurrency` groups are resident (Prepare + Runtime) at once; Reward and Transfer run
as each group finishes. A dropped group is not replaced within the step (its prompt goes back to the
data source); over-sampling and in-step replacement join with the credit issue.
"""

from __future__ import annotations

import asyncio
import time

from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline, StepResult


class SyncRuntime:
    """The baseline strategy; later modes subclass its knobs, not its loop."""

    def __init__(self, concurrency: int | None = None, eval_concurrency: int | None = None,
                 max_aborted_count: int = 2) -> None:
        self.concurrency = concurrency
        self.eval_concurrency = eval_concurrency
        self.max_aborted_count = max_aborted_count
        self.capacity = concurrency or 1

    def bind(self, capacity: int) -> None:
        """Set the resident capacity the run resolved (see `runtime.base.resident_capacity`)."""
        self.capacity = capacity

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        started = time.time()
        slots = asyncio.Semaphore(self.capacity)
        result = StepResult(rollout_id)

        async def one() -> None:
            async with slots:
                group = await pipeline.start_group(rollout_id)
                result.groups.append(group)
                exports = await pipeline.await_group(group)
            result.rows.extend(await pipeline.score_group(group, exports))

        await asyncio.gather(*(one() for _ in range(pipeline.batch_size)))
        result.groups.sort(key=_order)
        return pipeline.close_step(result, started)

    async def before_weight_update(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _order(group: Group) -> str:
    return group.id
