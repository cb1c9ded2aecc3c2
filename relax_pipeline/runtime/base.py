"""Runtime strategies: when groups start, how many are resident, and when a step closes.

Every mode of DESIGN §1 is a `RuntimeStrategy` over the same `Pipeline`: `sync` starts a step's
groups under the resident capacity and waits for them; `prelaunch` will start the next groups' agents
while capacity is free (first requests held until the lease); `partial` and `fully_async` will carry
unfinished sessions across steps, parking them around weight updates. The strategy never touches
stages directly, only the `Pipeline` group methods and the session states in the store.
"""

from __future__ import annotations

from typing import Protocol

from relax_pipeline.stages.pipeline import Pipeline, StepResult


class RuntimeStrategy(Protocol):
    """One scheduling mode."""

    def bind(self, capacity: int, over_sampling: int | None = None) -> None:
        """Take the resident capacity and the over-sampling batch size the run resolved."""

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        """Produce one step's groups (scored and transferred)."""

    async def before_weight_update(self) -> None:
        """Called before the trainer pushes new weights (partial modes park in-flight work here)."""

    async def close(self) -> None:
        """Terminate whatever the strategy still holds (prelaunched or carried-over groups)."""


def resident_capacity(concurrency: int | None, over_sampling: int | None, batch_size: int) -> int:
    """`runtime.concurrency`, defaulting to `rollout.over_sampling_batch_size`, then `rollout.batch_size`."""
    return concurrency or over_sampling or batch_size
