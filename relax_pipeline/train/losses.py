"""The GRPO-family policy loss of one micro-batch, as pure torch functions.

Order of operations in `policy_loss` (the contract the trainer backends rely on):

1. ratio = exp(logprobs - old_logprobs); `old_logprobs` are the engine's rollout logprobs or the
   logprobs the trainer recomputed before the update (the step chooses, see
   `trainer.loss.use_rollout_logprobs`).
2. PPO clipping with separate epsilons: pg = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)).
3. Off-policy corrections: truncated importance sampling (TIS) multiplies pg by the detached weight
   min(exp(old - rollout), tis_cap); off-policy sequence masking (OPSM) drops whole sequences whose
   advantage (sum over mask-1 tokens) is negative AND whose mean rollout-minus-current logprob over
   mask-1 tokens exceeds opsm_delta. Dropped sequences still count in the normalizers.
4. loss = reduce(pg) - entropy_coef * reduce(entropy) + kl_loss_coef * reduce(kl_estimate(...))
   + distill_coef * reduce(k3 to the teacher) (the design's optional distillation term).

Every tensor of a `LossBatch` is [B, T] on response positions. Mask-0 tokens (padding, observations)
never reach the loss or the gradient: their inputs are replaced by zeros before any arithmetic, so even
NaN or inf padding is harmless. `reduce` divides by the GLOBAL batch's normalizers, so summing the
losses (and the metrics) of the micro-batches of one optimizer step gives exactly the global-batch loss.

What this module does not do: compute logprobs or entropies from logits, pick micro-batches, step the
optimizer, or shape rewards with KL (train/advantages.py does that for the reinforce++ estimators).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

REDUCTIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


@dataclass
class LossSettings:
    """The `trainer.loss` node, as `policy_loss` takes it; connects the `trainer` config group to the loss.

    Not frozen: OmegaConf turns frozen dataclasses into read-only nodes, which overrides could not change.
    """

    eps_clip_low: float = 0.2
    """PPO clip range below 1."""
    eps_clip_high: float = 0.28
    """PPO clip range above 1."""
    use_rollout_logprobs: bool = True
    """Ratio against the engine's logprobs (True) or logprobs recomputed by the trainer before the step."""
    tis_cap: float | None = None
    """Truncated importance sampling cap on exp(old - rollout) logprobs; None disables TIS."""
    opsm_delta: float | None = None
    """Off-policy sequence masking: drop negative-advantage sequences whose KL to the rollout exceeds this."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    use_kl_loss: bool = False
    """Add a reference-KL loss against a frozen copy of the initial policy."""
    kl_loss_coef: float = 0.0
    """Weight of the reference-KL loss."""
    kl_loss_type: str = "k3"
    """KL estimator: k1, k2 or k3."""
    distill_coef: float = 0.0
    """Weight of the distillation term: the reverse KL from the policy to `trainer.teacher` on the generated tokens
    (k3 estimator on the sampled tokens' logprobs), logged as `train/distill_loss`; 0 turns it off."""
    loss_reduction: str = "token_mean"
    """token_mean, seq_mean_token_sum or seq_mean_token_mean."""

    def __post_init__(self) -> None:
        _check_range("eps_clip_low", self.eps_clip_low, 0.0, 1.0, "a number in [0, 1)")
        _check_range("eps_clip_high", self.eps_clip_high, 0.0, math.inf, "a number >= 0")
        _check_range("entropy_coef", self.entropy_coef, 0.0, math.inf, "a number >= 0")
        _check_range("kl_loss_coef", self.kl_loss_coef, 0.0, math.inf, "a number >= 0")
        _check_range("distill_coef", self.distill_coef, 0.0, math.inf, "a number >= 0 (0: no distillation)")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap > 0):
            raise ValueError(f"trainer.loss.tis_cap={self.tis_cap}; use null (TIS off) or a number > 0")
        if self.opsm_delta is not None:
            _check_range("opsm_delta", self.opsm_delta, 0.0, math.inf, "null (OPSM off) or a number >= 0")
        _check_choice("kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        _check_choice("loss_reduction", self.loss_reduction, REDUCTIONS)


def _check_range(key: str, value: float, low: float, high: float, allowed: str) -> None:
    """Half-open [low, high) check for finite numbers; the error names trainer.loss.<key>."""
    if not (isinstance(value, int | float) and math.isfinite(value) and low <= value < high):
        raise ValueError(f"trainer.loss.{key}={value!r}; use {allowed}")


def _check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"trainer.loss.{key}={value!r}; choose one of {list(allowed)}")


@dataclass(kw_only=True)
class LossBatch:
    """One micro-batch of response-aligned [B, T] tensors; connects a trainer backend to `policy_loss`.

    T is the longest response in the micro-batch, right-padded with loss_mask 0. `token_normalizer` is
    the number of mask-1 tokens and `seq_normalizer` the number of sequences of the GLOBAL batch (the
    optimizer step) this micro-batch belongs to. Only `logprobs` (and `entropy`) should carry gradient.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    token_normalizer: float
    seq_normalizer: float

    def __post_init__(self) -> None:
        shape = self.loss_mask.shape
        if len(shape) != 2:
            raise ValueError(f"LossBatch.loss_mask must be [B, T], got {tuple(shape)}")
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "advantages", "entropy", "ref_logprobs",
                     "teacher_logprobs"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != shape:
                raise ValueError(f"LossBatch.{name} is {tuple(tensor.shape)}; it must match loss_mask {tuple(shape)}")
        for name in ("token_normalizer", "seq_normalizer"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LossBatch.{name}={value}; it must be > 0 (a count over the global batch)")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs (Schulman's k1/k2/k3)."""
    _check_choice("kl_loss_type", kind, KL_ESTIMATORS)
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.exp(-log_ratio) + log_ratio - 1.0


def reduce(values: torch.Tensor, mask: torch.Tensor, reduction: str, token_normalizer: float,
           seq_normalizer: float) -> torch.Tensor:
    """Scalar reduction of per-token values over mask-1 tokens, divided by the global-batch normalizers.

    token_mean: sum(v*m) / token_normalizer. seq_mean_token_sum: sum of row sums / seq_normalizer.
    seq_mean_token_mean: sum of row means / seq_normalizer; a row without mask-1 tokens contributes 0.
    """
    _check_choice("loss_reduction", reduction, REDUCTIONS)
    masked = torch.where(mask > 0, values * mask, 0.0)
    if reduction == "token_mean":
        return masked.sum() / token_normalizer
    row_sums = masked.sum(dim=1)
    if reduction == "seq_mean_token_mean":
        row_sums = row_sums / mask.sum(dim=1).clamp(min=1)
    return row_sums.sum() / seq_normalizer


def policy_loss(batch: LossBatch, settings: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch loss (a scalar with gradient) and its metrics (floats, summable over micro-batches).

    Metrics: pg_loss, entropy (when given), kl (when use_kl_loss) and distill_loss (when distill_coef > 0) use the
    loss reduction, so loss == pg_loss - entropy_coef * entropy + kl_loss_coef * kl + distill_coef * distill_loss;
    ppo_kl, clipfrac and tis_clipfrac are means over the mask-1 tokens (token_normalizer); opsm_masked is a
    fraction of sequences (seq_normalizer).
    """
    _check_inputs(batch, settings)
    valid = batch.loss_mask > 0
    logprobs = _clean(batch.logprobs, valid)
    old = _clean(batch.old_logprobs.detach(), valid)
    pg, metrics = _ppo_term(batch, logprobs, old, settings)
    loss = _add(metrics, "pg_loss", _reduce(pg, batch, settings))
    if batch.entropy is not None:
        entropy = _add(metrics, "entropy", _reduce(_clean(batch.entropy, valid), batch, settings))
        loss = loss - settings.entropy_coef * entropy
    if settings.use_kl_loss and batch.ref_logprobs is not None:
        ref = _clean(batch.ref_logprobs.detach(), valid)
        kl = _add(metrics, "kl", _reduce(kl_estimate(logprobs, ref, settings.kl_loss_type), batch, settings))
        loss = loss + settings.kl_loss_coef * kl
    if settings.distill_coef > 0 and batch.teacher_logprobs is not None:
        teacher = _clean(batch.teacher_logprobs.detach(), valid)
        distill = _add(metrics, "distill_loss", _reduce(kl_estimate(logprobs, teacher, "k3"), batch, settings))
        loss = loss + settings.distill_coef * distill
    return loss, metrics


def _check_inputs(batch: LossBatch, settings: LossSettings) -> None:
    if settings.use_kl_loss and batch.ref_logprobs is None:
        raise ValueError("trainer.loss.use_kl_loss=true needs LossBatch.ref_logprobs (the frozen reference's logprobs)")
    if settings.distill_coef > 0 and batch.teacher_logprobs is None:
        raise ValueError("trainer.loss.distill_coef > 0 needs LossBatch.teacher_logprobs (set trainer.teacher)")
    if settings.entropy_coef > 0 and batch.entropy is None:
        raise ValueError(f"trainer.loss.entropy_coef={settings.entropy_coef} needs LossBatch.entropy")


def _clean(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Zeros on mask-0 tokens, selected (not multiplied) so NaN/inf padding gives no NaN gradient."""
    return torch.where(valid, tensor, torch.zeros_like(tensor))


def _reduce(values: torch.Tensor, batch: LossBatch, settings: LossSettings) -> torch.Tensor:
    return reduce(values, batch.loss_mask, settings.loss_reduction, batch.token_normalizer, batch.seq_normalizer)


def _token_mean(values: torch.Tensor, batch: LossBatch) -> float:
    """Diagnostics (ppo_kl, clip fractions): mean over the mask-1 tokens of the global batch."""
    return float(reduce(values.detach(), batch.loss_mask, "token_mean", batch.token_normalizer, 1.0))


def _add(metrics: dict[str, float], name: str, value: torch.Tensor) -> torch.Tensor:
    metrics[name] = float(value.detach())
    return value


def _ppo_term(batch: LossBatch, logprobs: torch.Tensor, old: torch.Tensor,
              settings: LossSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped pg loss after TIS and OPSM, with the ratio and off-policy metrics."""
    valid = batch.loss_mask > 0
    advantages = _clean(batch.advantages.detach(), valid)
    pg, clipped = _clipped_pg(logprobs - old, advantages, settings.eps_clip_low, settings.eps_clip_high)
    metrics = {"ppo_kl": _token_mean(old - logprobs, batch), "clipfrac": _token_mean(clipped.to(pg.dtype), batch)}
    rollout = _clean(batch.rollout_logprobs.detach(), valid)
    if settings.tis_cap is not None:
        pg = pg * _tis_weights(old - rollout, settings.tis_cap, batch, metrics)
    if settings.opsm_delta is not None:
        pg = pg * _opsm_keep(batch, advantages, rollout - logprobs.detach(), settings.opsm_delta, metrics)
    return pg, metrics


def _clipped_pg(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) and where the clipped term won."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _tis_weights(old_minus_rollout: torch.Tensor, cap: float, batch: LossBatch,
                 metrics: dict[str, float]) -> torch.Tensor:
    """Detached truncated importance weights min(exp(old - rollout), cap) and the fraction that hit the cap."""
    raw = torch.exp(old_minus_rollout.detach())
    metrics["tis_clipfrac"] = _token_mean((raw > cap).to(raw.dtype), batch)
    return raw.clamp(max=cap)


def _opsm_keep(batch: LossBatch, advantages: torch.Tensor, rollout_minus_current: torch.Tensor, delta: float,
               metrics: dict[str, float]) -> torch.Tensor:
    """[B, 1] keep mask: 0 for sequences with negative advantage AND mean(rollout - current) > delta."""
    counts = batch.loss_mask.sum(dim=1).clamp(min=1)
    seq_kl = (rollout_minus_current * batch.loss_mask).sum(dim=1) / counts
    negative = (advantages * batch.loss_mask).sum(dim=1) < 0
    dropped = negative & (seq_kl > delta)
    metrics["opsm_masked"] = float(dropped.sum()) / batch.seq_normalizer
    return (~dropped).to(advantages.dtype).unsqueeze(1)
