"""Credit from exported rewards: a primary scalar per context and group-normalized advantages.

A context's reward is what the agent exported: a number, or an object whose `credit.reward_key` field
is the primary value (its other numeric fields are kept for metrics). `null` or absent rewards stay
`None`. The base scalar credit of a group comes from `credit.estimator` (`credit/advantage.py`: GRPO's
group-centred reward, optionally std-normalized, RLOO, REINFORCE++); a group with any missing reward gets
no advantage. Custom reward models, group RMs and the per-context advantage hook join with the credit
issue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from relax_pipeline.credit.advantage import ESTIMATORS, base_advantages


class RewardError(ValueError):
    """An exported reward that has no usable primary value; the message names the key."""


class RewardCredit:
    """`credit=reward`: read rewards from the agents' outputs; base credit per group by the estimator."""

    def __init__(self, reward_key: str | None = None, rm_path: str | None = None, advantage_path: str | None = None,
                 estimator: str = "grpo", normalize_std: bool = True, kl_coef: float = 0.0,
                 normalize_advantages: bool = False, log_passrate: bool = False) -> None:
        if rm_path is not None or advantage_path is not None:
            raise ValueError("credit.rm_path and credit.advantage_path need credit=custom_rm / custom_advantage, "
                             "which land with the credit issue")
        if estimator not in ESTIMATORS:
            raise ValueError(f"credit.estimator={estimator!r}; choose one of {list(ESTIMATORS)}")
        self.reward_key = reward_key
        self.estimator = estimator
        self.normalize_std = normalize_std
        self.kl_coef = kl_coef
        self.normalize_advantages = normalize_advantages
        self.log_passrate = log_passrate

    def primary(self, reward: Any) -> float | None:
        """The primary scalar of an exported reward (number, object with reward_key, or null)."""
        if reward is None:
            return None
        if isinstance(reward, bool):
            return float(reward)
        if isinstance(reward, int | float):
            return _finite(float(reward), "reward")
        if isinstance(reward, dict):
            return self._from_object(reward)
        raise RewardError(f"reward must be a number, an object or null, got {type(reward).__name__}")

    def _from_object(self, reward: dict[str, Any]) -> float | None:
        if self.reward_key is None:
            raise RewardError("the exported reward is an object; set credit.reward_key to its primary field "
                              f"(one of {sorted(reward)})")
        if self.reward_key not in reward:
            raise RewardError(f"reward object has no {self.reward_key!r} (credit.reward_key); it has {sorted(reward)}")
        return self.primary(reward[self.reward_key])

    def advantages(self, rewards: Sequence[float | None]) -> list[float | None]:
        """Base credit of one group by `credit.estimator`; a group with a missing reward gets none."""
        if not rewards or any(r is None for r in rewards):
            return [None] * len(rewards)
        return list(base_advantages([float(r) for r in rewards if r is not None], self.estimator, self.normalize_std))


def _finite(value: float, key: str) -> float:
    if not math.isfinite(value):
        raise RewardError(f"{key} must be finite, got {value}")
    return value
