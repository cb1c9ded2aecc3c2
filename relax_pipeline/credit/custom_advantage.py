"""`credit=custom_advantage`: the user's function gives every exported context its base credit.

`credit.advantage_path` names `f(metadata_by_slot) -> list[dict[str | None, float]] | None` (sync or
async), called once per complete group in train mode with one mapping per session in group order: export
name (None for the implicit context) → that export's final metadata. It returns one mapping per session
with a finite number for every exported name; that number is the context's base credit (the dump's
`advantage`) and skips group normalization (`credit.normalize_advantages` whitening still applies in the
trainer). Returning None filters the whole group: its sessions end `filtered` and its prompt goes back to
the data source. Rewards are still read from the exports, for the dump and the metrics.

A malformed result (or an exception) drops the group with an error naming `credit.advantage_path`, the slot
and the name (`stages/reward.py`); the run goes on with a replacement group.
Eval groups never call the function: they get the estimator's credit, as with `credit=reward`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from relax_pipeline.credit.base import call_user, filter_group
from relax_pipeline.credit.records import CreditGroup
from relax_pipeline.credit.reward import RewardCredit

Slot = dict[str | None, Any]


class AdvantageError(ValueError):
    """The advantage function's result breaks its contract; the message names the slot and the name."""


class CustomAdvantageCredit(RewardCredit):
    """`credit=custom_advantage`: base credit per context from the user's advantage function."""

    option = "custom_advantage"
    uses = ("advantage_path",)
    several_contexts = True
    needs_reward = False

    async def score(self, group: CreditGroup) -> None:
        await self.fill_rewards(group)
        await hook_advantages(self, group, self.user_function, self.advantage_path)


async def hook_advantages(credit: RewardCredit, group: CreditGroup, function: Callable[..., Any],
                          path: str | None) -> None:
    """Base credit from the advantage function for a train group whose rewards are filled; eval groups get
    the estimator's credit. Returning None filters the group."""
    if group.mode == "eval":
        credit.fill_advantages(group)
        return
    slots = metadata_by_slot(group)
    result = await call_user(function, copy.deepcopy(slots))
    if result is None:
        filter_group(group, "credit.advantage_path returned None for this group")
        return
    values = check_advantages(result, slots, path)
    for context in group.contexts:
        context.advantage = values[context.slot][context.name]


def metadata_by_slot(group: CreditGroup) -> list[Slot]:
    """One mapping per session in group order: export name → that export's final metadata."""
    slots: list[Slot] = [{} for _ in range(group.slots)]
    for context in group.contexts:
        slots[context.slot][context.name] = context.metadata
    return slots


def check_advantages(result: Any, slots: list[Slot], path: str | None) -> list[dict[str | None, float]]:
    """The function's result as floats, or an AdvantageError naming the slot and the name."""
    where = f"credit.advantage_path={path!r}"
    if not isinstance(result, list | tuple) or len(result) != len(slots):
        got = f"{len(result)} mappings" if isinstance(result, list | tuple) else type(result).__name__
        raise AdvantageError(f"{where} returned {got} for {len(slots)} sessions; return one mapping per session "
                             "in group order, or None to filter the group")
    return [_check_slot(i, mapping, slot, where) for i, (mapping, slot) in enumerate(zip(result, slots, strict=True))]


def _check_slot(i: int, mapping: Any, slot: Slot, where: str) -> dict[str | None, float]:
    if not isinstance(mapping, dict):
        raise AdvantageError(f"{where}: slot {i} must be a dict of export name → advantage, "
                             f"got {type(mapping).__name__}")
    for name in mapping:
        if name not in slot:
            raise AdvantageError(f"{where}: slot {i} name {name!r} was not exported by that session "
                                 f"(it exported {list(slot)})")
    return {name: _number(i, name, mapping, where) for name in slot}


def _number(i: int, name: str | None, mapping: dict[Any, Any], where: str) -> float:
    if name not in mapping:
        raise AdvantageError(f"{where}: slot {i} name {name!r} is missing; give every exported name an advantage")
    value = mapping[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdvantageError(f"{where}: slot {i} name {name!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise AdvantageError(f"{where}: slot {i} name {name!r} must be finite, got {value}")
    return float(value)
