"""Capacity: the run's resident groups, computed once, and the agent slots it needs at its peak.

`Capacity.resolve` turns `runtime.concurrency` (default `rollout.over_sampling_batch_size`, then
`rollout.batch_size`), `rollout.n_samples_per_prompt` and `runtime.eval_concurrency` into one value that
`recipes/parts.py` computes once and passes to the strategy, the evaluator and the slot check; nothing else
recomputes it.

Agents that run on an external platform (a sandbox service with `runtime.external_slots` slots) need a
slot per live session. The numbers, per run:

| symbol | meaning |
| --- | --- |
| `T` | train sessions resident: resident groups (`runtime.concurrency`) × `rollout.n_samples_per_prompt` |
| `G_d` | group size of eval dataset d (its `n_samples_per_prompt`) |
| `C_d` | eval groups in flight for d: `runtime.eval_concurrency` or `ceil(T / G_d)` |
| `E_d` | eval sessions in flight for d: `C_d × G_d` |
| `E_peak` | `max_d E_d` (eval datasets run one after another) |

Required slots: `T` without eval; with eval, `max(T, E_peak)` under `sync` (no train session outlives
its step) and `T + E_peak` under `prelaunch`, `partial` and `fully_async`, which retain train sessions
(held, parked or running) while eval runs. `job=check` prints the table; every job refuses to start
when `runtime.external_slots` is set and smaller than the requirement. Local agents (no
`external_slots`) are not limited here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Capacity:
    """Resident groups and sessions of one run; connects the config to the strategy, eval and slot check."""

    groups: int
    """Resident prompt groups (Prepare + Runtime)."""
    group_size: int
    """`rollout.n_samples_per_prompt`."""
    eval_concurrency: int | None = None
    """`runtime.eval_concurrency` (eval groups in flight per dataset), None for the default."""

    @classmethod
    def resolve(cls, concurrency: int | None, over_sampling: int | None, batch_size: int, group_size: int,
                eval_concurrency: int | None = None) -> Capacity:
        """`runtime.concurrency`, defaulting to `rollout.over_sampling_batch_size`, then `rollout.batch_size`."""
        return cls(concurrency or over_sampling or batch_size, group_size, eval_concurrency)

    @property
    def sessions(self) -> int:
        """T: train sessions resident."""
        return self.groups * self.group_size

    def eval_groups(self, group_size: int) -> int:
        """C_d of an eval dataset of group size `group_size`."""
        return eval_groups(self.sessions, group_size, self.eval_concurrency)


@dataclass(frozen=True)
class EvalLoad:
    """One eval dataset's share of the slots; connects eval settings to the slot plan."""

    name: str
    group_size: int
    """G_d."""
    groups: int
    """C_d."""

    @property
    def sessions(self) -> int:
        """E_d."""
        return self.groups * self.group_size


@dataclass(frozen=True)
class SlotPlan:
    """The slot numbers of one run; connects the config to `job=check` and the start-up refusal."""

    train_sessions: int
    """T."""
    evals: tuple[EvalLoad, ...]
    retains: bool
    """The runtime mode keeps train sessions alive while eval runs."""
    eval_pool: bool = False
    """Eval sessions run on a pool of their own (`eval.agent`): each pool needs its own slots."""

    @property
    def eval_peak(self) -> int:
        """E_peak (0 without eval)."""
        return max((e.sessions for e in self.evals), default=0)

    @property
    def required(self) -> int:
        """Slots of the train pool (the only pool without `eval_pool`)."""
        if not self.evals or self.eval_pool:
            return self.train_sessions
        if self.retains:
            return self.train_sessions + self.eval_peak
        return max(self.train_sessions, self.eval_peak)

    def lines(self) -> list[str]:
        """The table as log lines."""
        out = [f"T = {self.train_sessions} train sessions"]
        out += [f"eval {e.name}: G_d = {e.group_size}, C_d = {e.groups}, E_d = {e.sessions}" for e in self.evals]
        rule = "T + E_peak (train sessions retained)" if self.retains else "max(T, E_peak)"
        if self.evals and self.eval_pool:
            out.append(f"train pool: required slots = T = {self.required}; eval pool (eval.agent): required slots = "
                       f"E_peak = {self.eval_peak}")
        elif self.evals:
            out.append(f"E_peak = {self.eval_peak}; required slots = {rule} = {self.required}")
        else:
            out.append(f"required slots = T = {self.required}")
        return out


def eval_groups(train_sessions: int, group_size: int, eval_concurrency: int | None) -> int:
    """C_d: `runtime.eval_concurrency`, or `ceil(T / G_d)`."""
    return eval_concurrency or math.ceil(train_sessions / group_size)


def check_slots(plan: SlotPlan, external_slots: int | None, eval_slots: int | None = None) -> None:
    """Refuse, with the numbers, when the external platform (or the eval pool, `eval.agent.slots`) has fewer slots
    than the run needs."""
    if plan.eval_pool and eval_slots is not None and eval_slots < plan.eval_peak:
        raise ValueError(f"eval.agent.slots={eval_slots} is too few: eval needs {plan.eval_peak} agent slots ("
                         + "; ".join(plan.lines()) + "). Raise eval.agent.slots, or lower runtime.eval_concurrency "
                         "or the eval n_samples_per_prompt")
    if external_slots is None or external_slots >= plan.required:
        return
    raise ValueError(
        f"runtime.external_slots={external_slots} is too few: this run needs {plan.required} agent slots ("
        + "; ".join(plan.lines())
        + "). Raise runtime.external_slots, or lower runtime.concurrency, runtime.eval_concurrency or the "
          "eval n_samples_per_prompt"
    )
