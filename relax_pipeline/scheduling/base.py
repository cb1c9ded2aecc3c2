"""Runtime strategies: when groups start, how many are resident, and when a step closes.

Every mode of docs/design.md §2.4 is a `RuntimeStrategy` over the same `Pipeline` and `GroupPool`:

- `sync`: each step leases its groups under the resident capacity and waits for them;
- `prelaunch`: as sync, and once a step has its groups the next step's agents start while the trainer
  works, their first requests held until the next step leases them;
- `partial`: at step close the unfinished groups are parked (in-flight generations aborted, resumed in
  the next step with their partial tokens) instead of terminated;
- `fully_async`: generation never stops for training; each step takes `rollout.batch_size` finished
  groups, generations are preempted only around weight updates, `runtime.max_staleness` bounds how old
  a sample's first token may be, and the last step drains what is left.

A strategy never touches stages directly, only the `Pipeline` group methods, the pool and the leases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from relax_pipeline.engine.base import Engine
from relax_pipeline.stages.pipeline import Pipeline, StepResult


@dataclass(frozen=True)
class Binding:
    """What the run resolved for its strategy; connects the recipes (`recipes/parts.py`) to the strategy."""

    capacity: int
    """Resident prompt groups (`stages.capacity.Capacity.groups`)."""
    engine: Engine
    """The engine whose generations leases abort and resume."""
    over_sampling: int | None = None
    """`rollout.over_sampling_batch_size`."""
    num_steps: int | None = None
    """`rollout.num_steps`: the step with id num_steps - 1 is the last (nothing is carried past it)."""


class RuntimeStrategy(Protocol):
    """One scheduling mode."""

    retains_train_sessions: bool
    """Train sessions stay alive while eval runs (prelaunched, parked or running); see `runtime.capacity`."""

    def bind(self, binding: Binding) -> None:
        """Take the resident capacity, the engine and the step count the run resolved."""

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        """Produce one step's groups (scored and transferred)."""

    async def before_weight_update(self) -> None:
        """Called after training and before the new weights reach the engine (fully_async preempts here)."""

    async def after_weight_update(self) -> None:
        """Called once the engine serves the new weights (fully_async resumes here)."""

    async def close(self) -> None:
        """Terminate whatever the strategy still holds (prelaunched or carried-over groups)."""
