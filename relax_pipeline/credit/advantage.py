"""Advantage estimators of the GRPO family: group credit, token expansion, batch whitening.

The credit pipeline has three pure steps, applied in this order:

1. `base_advantages`: one base scalar per exported context of ONE group (the value the rollout dump
   records as `advantage`). grpo centres by the group mean and, with `normalize_std`, divides by the
   group's unbiased std (ddof=1) plus `eps`; rloo subtracts the mean of the other n-1 rewards;
   reinforce_plus_plus keeps the reward itself (its normalization is the batch whitening);
   reinforce_plus_plus_baseline subtracts the group mean without any std division.
2. `token_advantages`: the base scalar spread over the response's loss-mask-1 tokens. grpo/rloo
   broadcast it; the reinforce++ estimators build per-token rewards (-kl_coef * kl on every mask-1
   token, plus the base scalar at the last mask-1 token) and write the undiscounted return-to-go.
   Multi-turn responses have several loss-1 spans separated by observation tokens: observations carry
   no reward and get advantage 0, and returns flow across them unchanged.
3. `whiten`: optional batch whitening over the mask-1 tokens of the whole batch.

What this module does not do: read rewards (credit/reward.py), call user advantage hooks, compute the
KL itself (the trainer passes the old policy's per-token k1 to the reference), or discount (gamma=1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_SHAPING_ESTIMATORS: tuple[str, ...] = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def check_estimator(estimator: str) -> None:
    """Raise a ValueError naming `credit.estimator` when `estimator` is not one of ESTIMATORS."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"credit.estimator={estimator!r}; choose one of {list(ESTIMATORS)}")


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


def token_advantages(base: torch.Tensor, loss_mask: torch.Tensor, estimator: str, kl: torch.Tensor | None = None,
                     kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token advantages [B, T] from base scalars [B]: non-zero only on loss-mask-1 tokens.

    `kl` [B, T] is the old policy's per-token k1 KL to the reference, used only by the reinforce++
    estimators when `kl_coef` > 0. grpo/rloo do not support KL reward shaping: use trainer.use_kl_loss.
    """
    check_estimator(estimator)
    _check_token_inputs(base, loss_mask, kl, kl_coef)
    valid = loss_mask > 0
    if estimator not in KL_SHAPING_ESTIMATORS:
        if kl_coef > 0:
            raise ValueError(f"credit.kl_coef={kl_coef} (KL reward shaping) is not supported by credit.estimator="
                             f"{estimator!r}; use one of {list(KL_SHAPING_ESTIMATORS)} or set trainer.use_kl_loss=true "
                             "with trainer.kl_loss_coef instead")
        return torch.where(valid, base.unsqueeze(1).expand_as(loss_mask), 0.0).to(base.dtype)
    rewards = _token_rewards(base, valid, kl, kl_coef)
    returns = rewards.flip(1).cumsum(1).flip(1)
    return torch.where(valid, returns, 0.0)


def _check_token_inputs(base: torch.Tensor, loss_mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> None:
    if loss_mask.dim() != 2 or base.shape != (loss_mask.shape[0],):
        raise ValueError(f"base must be [B] and loss_mask [B, T], got {tuple(base.shape)} and {tuple(loss_mask.shape)}")
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"credit.kl_coef must be a finite number >= 0, got {kl_coef}")
    if kl_coef > 0 and kl is None:
        raise ValueError(f"credit.kl_coef={kl_coef} needs the per-token kl [B, T]; got kl=None")
    if kl is not None and kl.shape != loss_mask.shape:
        raise ValueError(f"kl must match loss_mask {tuple(loss_mask.shape)}, got {tuple(kl.shape)}")


def _token_rewards(base: torch.Tensor, valid: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -kl_coef * kl on mask-1 tokens, plus the base at each row's last mask-1 token."""
    rewards = torch.zeros(valid.shape, dtype=base.dtype, device=base.device)
    if kl is not None and kl_coef > 0:
        rewards = torch.where(valid, -kl_coef * kl.to(base.dtype), rewards)
    width = valid.shape[1]
    last = width - 1 - valid.flip(1).to(torch.int8).argmax(dim=1)
    has_tokens = valid.any(dim=1)
    rows = torch.arange(valid.shape[0], device=valid.device)
    rewards[rows[has_tokens], last[has_tokens]] += base[has_tokens]
    return rewards


def whiten(advantages: torch.Tensor, loss_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(a - mean) / (std + eps) over the mask-1 tokens of the whole batch; 0 on mask-0 tokens.

    The std is the unbiased sample std (ddof=1) of the mask-1 tokens; with fewer than two mask-1
    tokens every token is 0 (nothing is left after centring).
    """
    if advantages.shape != loss_mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    valid = loss_mask > 0
    count = int(valid.sum())
    if count < 2:
        return torch.zeros_like(advantages)
    values = advantages[valid]
    centred = advantages - values.mean()
    std = values.std(unbiased=True)
    return torch.where(valid, centred / (std + eps), 0.0)
