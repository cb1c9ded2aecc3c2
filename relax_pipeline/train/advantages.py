"""Advantages as the trainer uses them: token expansion of base scalars, batch whitening.

The credit stage gives every exported context one base scalar (`credit/advantage.py`); the trainer turns
it into per-token advantages here, in this order:

1. `token_advantages`: the base scalar spread over the response's loss-mask-1 tokens. grpo/rloo
   broadcast it; the reinforce++ estimators build per-token rewards (-kl_coef * kl on every mask-1
   token, plus the base scalar at the last mask-1 token) and write the undiscounted return-to-go.
   Multi-turn responses have several loss-1 spans separated by observation tokens: observations carry
   no reward and get advantage 0, and returns flow across them unchanged.
2. `whiten`: optional batch whitening over the mask-1 tokens of the whole global batch.

The estimator names and `AdvantageSettings` (the credit keys the trainer must agree on) are credit's own
(`credit/settings.py`); this module reads them.

What this module does not do: read rewards or compute group credit (credit/), compute the KL itself
(the trainer passes the old policy's per-token k1 to the reference), or discount (gamma=1).
"""

from __future__ import annotations

import torch

from relax_pipeline.credit.settings import KL_SHAPING_ESTIMATORS, check_estimator, check_kl_coef


def token_advantages(base: torch.Tensor, loss_mask: torch.Tensor, estimator: str, kl: torch.Tensor | None = None,
                     kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token advantages [B, T] from base scalars [B]: non-zero only on loss-mask-1 tokens.

    `kl` [B, T] is the old policy's per-token k1 KL to the reference, used only by the reinforce++
    estimators when `kl_coef` > 0. grpo/rloo do not support KL reward shaping: use trainer.loss.use_kl_loss.
    """
    check_estimator(estimator)
    _check_token_inputs(base, loss_mask, kl, kl_coef)
    check_kl_coef(estimator, kl_coef)
    valid = loss_mask > 0
    if estimator not in KL_SHAPING_ESTIMATORS:
        return torch.where(valid, base.unsqueeze(1).expand_as(loss_mask), 0.0).to(base.dtype)
    rewards = _token_rewards(base, valid, kl, kl_coef)
    returns = rewards.flip(1).cumsum(1).flip(1)
    return torch.where(valid, returns, 0.0)


def _check_token_inputs(base: torch.Tensor, loss_mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> None:
    if loss_mask.dim() != 2 or base.shape != (loss_mask.shape[0],):
        raise ValueError(f"base must be [B] and loss_mask [B, T], got {tuple(base.shape)} and {tuple(loss_mask.shape)}")
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
