"""The `runtime` node as one record: the runtime mode's switches and every `runtime.*` key, declared once.

`RuntimeSettings` holds the keys of all four modes. The mode is three independent switches (the design's flags):
`prelaunch` (start the next step's agents while the trainer works), `partial_rollout` (park unfinished groups at
step close, resume them next step) and `fully_async` (continuous generation; steps take finished groups); the
`runtime=<name>` presets set them. `_target_`, the class, follows from the switches (`MODES`) unless a user names
a class of their own. Every combination works or is refused here with the reason: prelaunch and partial rollout
combine (`PrelaunchPartialRuntime`); fully_async already preempts and resumes every in-flight request around each
weight update (request-level partial rollout), so `partial_rollout` adds nothing to it and is accepted, while
`prelaunch` is refused (agents already start continuously). The
capacity keys (`concurrency`, `eval_concurrency`, `external_slots`) size the whole run: `recipes/parts.py` resolves them
once into `stages.capacity.Capacity` (`capacity_part`), and a strategy gets the result through `bind`. A key
that only one mode reads (`max_staleness`, fully_async's) must stay null under the others: the strategy
refuses it at construction, naming the key.

What it does not do: schedule anything (scheduling/sync.py and the modes built on it do).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityKeys:
    """The `runtime.*` keys that size the run (read once by `recipes/parts.py` into `Capacity`)."""

    concurrency: int | None
    eval_concurrency: int | None
    external_slots: int | None


_MODULE = "relax_pipeline.scheduling"
MODES: dict[tuple[bool, bool, bool], str] = {
    (False, False, False): f"{_MODULE}.sync.SyncRuntime",
    (True, False, False): f"{_MODULE}.prelaunch.PrelaunchRuntime",
    (False, True, False): f"{_MODULE}.partial.PartialRuntime",
    (True, True, False): f"{_MODULE}.prelaunch.PrelaunchPartialRuntime",
    (False, False, True): f"{_MODULE}.fully_async.FullyAsyncRuntime",
}
"""(prelaunch, partial_rollout, fully_async) → the strategy class (fully_async takes partial_rollout as it is)."""


@dataclass
class RuntimeSettings:
    """The `runtime` group's node; connects the config to the strategy its `_target_` names."""

    _target_: str = ""
    """The runtime mode's class; empty: the one the switches choose (`MODES`)."""
    prelaunch: bool = False
    """Start the next step's agents (held) while the trainer works."""
    partial_rollout: bool = False
    """Park unfinished groups at step close (in-flight generations aborted, partial tokens kept) and resume them
    next step, instead of ending them."""
    fully_async: bool = False
    """Generation and training overlap: the pool stays full, steps take finished groups."""
    concurrency: int | None = None
    """Resident prompt groups (Prepare + Runtime); None means rollout.over_sampling_batch_size."""
    eval_concurrency: int | None = None
    """Eval groups in flight per dataset; None: ceil(resident sessions / the dataset's group size)."""
    max_aborted_count: int = 2
    """Partial rollout: aborts after which a request is protected."""
    barrier_warn_s: float = 60.0
    """Log the missing sessions when a group's first-request barrier waits longer than this (credit=group_rm: an
    ordinary reward runs singleton runtime groups, with no barrier)."""
    max_staleness: int | None = None
    """fully_async: drop groups whose first token is more than this many weight versions old; None: no bound."""
    external_slots: int | None = None
    """Agent slots of an external platform; the start-up capacity check refuses too few. None: local agents."""

    def __post_init__(self) -> None:
        if self.fully_async and self.prelaunch:
            raise ValueError("runtime.fully_async=true with runtime.prelaunch=true: fully_async starts agents "
                             "continuously (the pool is kept full), so there is nothing to prelaunch; unset "
                             "runtime.prelaunch")
        if not self._target_:
            self._target_ = MODES[(self.prelaunch, self.partial_rollout and not self.fully_async, self.fully_async)]
        for key in ("concurrency", "eval_concurrency"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"runtime.{key} must be positive or null, got {value}")

    @property
    def capacity_part(self) -> CapacityKeys:
        return CapacityKeys(self.concurrency, self.eval_concurrency, self.external_slots)
