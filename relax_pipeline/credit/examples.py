"""Example user functions for `credit.rm_path` and `credit.advantage_path`; the defaults of the conf files.

`exact_match` (custom_rm) and `group_exact_match` (group_rm) score 1.0 when the last assistant message,
stripped, equals the prompt's `metadata.answer` as text, else 0.0 (the digits task). `outcome_times_usefulness`
(custom_advantage) gives the `main` context (or the implicit one) its metadata `outcome` and every other
context `outcome × usefulness` of its own metadata (usefulness 1.0 when absent); a session without an
outcome filters the group. `drop_uniform_rewards` (credit.filter_path) keeps a group only when its rewards
differ. They show the signatures; they are not meant to be good reward models.

`answer_reward(text, target)` is the exact-answer reward of `dataset=arith` (the arith agents import it):
1.0 when the last number in the text is an integer equal to the target (`last_integer`: thousands
separators allowed, `46.0` counts as 46, a `-` right after a digit or letter is subtraction, not a
sign), else 0.0. `exact_answer` is the same as a `credit.rm_path` reward model.
"""

from __future__ import annotations

import re
from typing import Any

MAIN_NAMES = ("main", None)
_NUMBER = re.compile(r"(?:(?<![\w).])-)?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def exact_match(sample: dict[str, Any]) -> float:
    """1.0 when the last assistant message equals `prompt.metadata.answer`, else 0.0."""
    answer = sample["prompt"].get("metadata", {}).get("answer")
    replies = [m.get("content") or "" for m in sample["messages"] if m["role"] == "assistant"]
    return float(answer is not None and bool(replies) and replies[-1].strip() == str(answer))


def group_exact_match(samples: list[dict[str, Any]]) -> list[float]:
    """`exact_match` of every sample of one group, in order."""
    return [exact_match(sample) for sample in samples]


def outcome_times_usefulness(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, float]] | None:
    """main: its `outcome`; every other context: that outcome × its own `usefulness`."""
    out = []
    for slot in metadata_by_slot:
        outcome = next((slot[n].get("outcome") for n in MAIN_NAMES if n in slot), None)
        if outcome is None:
            return None
        out.append({n: outcome if n in MAIN_NAMES else outcome * meta.get("usefulness", 1.0)
                    for n, meta in slot.items()})
    return out


def drop_uniform_rewards(samples: list[dict[str, Any]]) -> bool:
    """`credit.filter_path` example (dynamic sampling): keep a group only when its rewards differ."""
    return len({s.get("reward") for s in samples}) > 1


def last_integer(text: str) -> int | None:
    """The last number in `text` when it is an integer (`1,234` → 1234, `-7`, `46.0` → 46), else None."""
    numbers = _NUMBER.findall(_THOUSANDS.sub("", text))
    if not numbers:
        return None
    value = float(numbers[-1]) if "." in numbers[-1] else int(numbers[-1])
    return int(value) if value == int(value) else None


def answer_reward(text: str, target: Any) -> float:
    """1.0 when the last number of `text` is an integer equal to `target` (an int or its text), else 0.0."""
    try:
        expected = int(str(target).strip())
    except ValueError:
        return 0.0
    return float(last_integer(text) == expected)


def exact_answer(sample: dict[str, Any]) -> float:
    """`answer_reward` of the last assistant message against `prompt.metadata.answer` (credit.rm_path form)."""
    answer = sample["prompt"].get("metadata", {}).get("answer")
    replies = [m.get("content") or "" for m in sample["messages"] if m["role"] == "assistant"]
    return answer_reward(replies[-1], answer) if replies and answer is not None else 0.0


def main_exact_answer(samples: list[dict[str, Any]]) -> list[float | None]:
    """`credit=group_rm` example for sessions with a main agent and sub-agents: reviews only the main contexts
    (`exact_answer`), leaving the sub-agents' null for the advantage function to credit."""
    return [exact_answer(s) if s["name"] in MAIN_NAMES else None for s in samples]
