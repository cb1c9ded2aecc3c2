"""User functions that break their contract, for tests/e2e/test_faults.py (`credit.rm_path=fault_hooks.f`).

Each fails on its first two calls (one raises, one returns the wrong shape) and behaves afterwards, so the
groups it broke are dropped and replaced and the run finishes. `reset()` before each run.
"""

from __future__ import annotations

from typing import Any

CALLS: dict[str, int] = {}


def reset() -> None:
    CALLS.clear()


def _call(name: str) -> int:
    CALLS[name] = CALLS.get(name, 0) + 1
    return CALLS[name]


def group_rm(samples: list[dict[str, Any]]) -> Any:
    call = _call("group_rm")
    if call == 1:
        raise ZeroDivisionError("the reward model divided by zero")
    if call == 2:
        return [1.0] * (len(samples) + 1)
    return [float(i % 2) for i in range(len(samples))]


def advantage(slots: list[dict[str | None, Any]]) -> Any:
    call = _call("advantage")
    if call == 1:
        raise KeyError("no such metadata field")
    if call == 2:
        return {"not": "a list"}
    return [{name: float(i) - 0.5 for name in slot} for i, slot in enumerate(slots)]


def keep_after_first(samples: list[dict[str, Any]]) -> bool:
    """`credit.filter_path`: filter the first group scored, keep the others."""
    return _call("keep_after_first") > 1
