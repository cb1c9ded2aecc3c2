"""The `runtime` node as one record: the runtime mode's class and every `runtime.*` key, declared once.

`RuntimeSettings` holds the keys of all four modes; each mode's yaml names its class in `_target_`. The
capacity keys (`concurrency`, `eval_concurrency`, `external_slots`) size the whole run: `run.py` resolves them
once into `stages.capacity.Capacity` (`capacity_part`), and a strategy gets the result through `bind`. A key
that only one mode reads (`max_staleness`, fully_async's) must stay null under the others: the strategy
refuses it at construction, naming the key.

What it does not do: schedule anything (scheduling/sync.py and the modes built on it do).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityKeys:
    """The `runtime.*` keys that size the run (read once by `run.py` into `Capacity`)."""

    concurrency: int | None
    eval_concurrency: int | None
    external_slots: int | None


@dataclass
class RuntimeSettings:
    """The `runtime` group's node; connects the config to the strategy its `_target_` names."""

    _target_: str = "relax_pipeline.scheduling.sync.SyncRuntime"
    """The runtime mode's class (each `runtime=` option's yaml names its own)."""
    concurrency: int | None = None
    """Resident prompt groups (Prepare + Runtime); None means rollout.over_sampling_batch_size."""
    eval_concurrency: int | None = None
    """Eval groups in flight per dataset; None: ceil(resident sessions / the dataset's group size)."""
    max_aborted_count: int = 2
    """Partial rollout: aborts after which a request is protected."""
    barrier_warn_s: float = 60.0
    """Log the missing sessions when a group's first-request barrier waits longer than this."""
    max_staleness: int | None = None
    """fully_async: drop groups whose first token is more than this many weight versions old; None: no bound."""
    external_slots: int | None = None
    """Agent slots of an external platform; the start-up capacity check refuses too few. None: local agents."""

    def __post_init__(self) -> None:
        for key in ("concurrency", "eval_concurrency"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"runtime.{key} must be positive or null, got {value}")

    @property
    def capacity_part(self) -> CapacityKeys:
        return CapacityKeys(self.concurrency, self.eval_concurrency, self.external_slots)
