"""Advantage estimators of the GRPO family: the group credit, one base scalar per exported context.

`base_advantages` gives one base scalar per exported context of ONE group (the value the rollout dump
records as `advantage`). grpo centres by the group mean and, with `normalize_std`, divides by the
group's unbiased std (ddof=1) plus `eps`; rloo subtracts the mean of the other n-1 rewards;
reinforce_plus_plus keeps the reward itself (its normalization is the batch whitening);
reinforce_plus_plus_baseline subtracts the group mean without any std division.

What this module does not do: read rewards (credit/reward.py), call user advantage hooks, or expand the
scalar over tokens and whiten it (the trainer's, `train/advantages.py`). The estimator names are
`credit/settings.py`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from relax_pipeline.credit.settings import ESTIMATORS, check_estimator

__all__ = ["ESTIMATORS", "base_advantages", "check_estimator"]


def base_advantages(rewards: Sequence[float], estimator: str, normalize_std: bool = True,
                    eps: float = 1e-6) -> list[float]:
    """Base scalar credit of one group, one value per context in order.

    A group of one, or a group whose rewards are all equal, gets zeros from every estimator that
    centres (grpo, rloo, reinforce_plus_plus_baseline): after centring nothing is left to scale.
    `normalize_std` only affects grpo.
    """
    check_estimator(estimator)
    values = [_finite_reward(r, i) for i, r in enumerate(rewards)]
    if not values or estimator == "reinforce_plus_plus":
        return values
    if estimator == "rloo":
        return _leave_one_out(values)
    mean = sum(values) / len(values)
    centred = [v - mean for v in values]
    if estimator == "grpo" and normalize_std:
        return [c / (_unbiased_std(centred) + eps) for c in centred]
    return centred


def _finite_reward(reward: float, index: int) -> float:
    value = float(reward)
    if not math.isfinite(value):
        raise ValueError(f"reward {index} of the group must be finite, got {value}")
    return value


def _leave_one_out(values: list[float]) -> list[float]:
    """RLOO: each reward minus the mean of the other n-1 rewards; a group of one gets 0."""
    n = len(values)
    if n == 1:
        return [0.0]
    total = sum(values)
    return [v - (total - v) / (n - 1) for v in values]


def _unbiased_std(centred: list[float]) -> float:
    """Sample std (ddof=1) of already-centred values; 0 for a group of one."""
    if len(centred) < 2:
        return 0.0
    return math.sqrt(sum(c * c for c in centred) / (len(centred) - 1))
