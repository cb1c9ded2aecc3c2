"""Weight-version provenance of a training step: how old the weights were that sampled its trained tokens, and
how far the sampling policy is from the policy being trained, per lag.

Every generated token carries the weight version that sampled it (`Sample.weight_versions`, one per response
token). A step trains at the trainer's current `version`; a token's lag is how many versions behind that it was
sampled (0: by the weights being trained). `version_lag` reports, over the step's loss-carrying tokens, the share
at each lag (`train/version_lag/0` .. `/3`, and `/4+` for older), and the mean lag (`train/version_lag/mean`).
Under `runtime=sync` every share is at lag 0; `partial` and `fully_async` mix versions, and these metrics say how
much.

`lag_kl_sums` and `lag_kl_metrics` give, per lag bucket, the KL from the sampling policy μ (the behaviour logprob
the engine recorded per token) to the current policy π (the logprob the trainer computes for the loss), estimated
on the sampled tokens with the k3 estimator: with log r = log π - log μ, k3 = r - 1 - log r, an unbiased and
never negative estimate of KL(μ ‖ π) under samples from μ. `train/version_lag_kl/<k>` is its mean over the
bucket's loss-carrying tokens (a bucket without tokens is left out). `step.share_step` sums it per micro-batch (so
the "current policy" is the policy as it computes that micro-batch's loss: the step's starting weights for its
first optimizer step), across ranks like every other metric, and turns the sums into means per optimizer step.

`MicroBatchTime` records when each micro-batch of a step ran and which samples it trained (the trainers keep
them as `timeline`, one list per optimizer step), so a session's trace can show the micro-batches that consumed
its tokens.

What it does not do: the shares are about the samples as given; they do not say which tokens a filter dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from relax_pipeline.forest.sample import Sample

BUCKETS = 4
"""Lags 0 .. BUCKETS - 1 get a share each; older tokens share `BUCKETS+`."""
LABELS = tuple(str(k) for k in range(BUCKETS)) + (f"{BUCKETS}+",)
"""The bucket names, in order: `0`, `1`, ..., `4+`."""
_KL_SUM, _KL_TOKENS = "version_lag_kl_sum/", "version_lag_kl_tokens/"


@dataclass(frozen=True)
class MicroBatchTime:
    """When one micro-batch ran on this rank (its forward, loss and backward) and which samples it held; connects
    `step.share_step` to the session traces (the step loop reads the trainer's `timeline`)."""

    index: int
    start_ns: int
    """Epoch nanoseconds."""
    end_ns: int
    samples: tuple[Sample, ...]


def version_lag(samples: Sequence[Sample], current: int) -> dict[str, float]:
    """Shares of the loss-carrying tokens by lag behind `current`, and the mean lag; {} when no token says
    its version (samples made by hand)."""
    lags = [current - version for s in samples if len(s.weight_versions) == len(s.loss_mask)
            for mask, version in zip(s.loss_mask, s.weight_versions, strict=True) if mask]
    if not lags:
        return {}
    counts = Counter(min(max(lag, 0), BUCKETS) for lag in lags)
    shares = {f"train/version_lag/{LABELS[k]}": counts[k] / len(lags) for k in range(BUCKETS + 1)}
    return {**shares, "train/version_lag/mean": sum(lags) / len(lags)}


def lag_buckets(samples: Sequence[Sample], current: int, width: int) -> torch.Tensor:
    """[B, width] bucket index (0 .. BUCKETS) of each response token of `samples`, -1 on padding and on samples
    that do not say their versions."""
    rows = []
    for s in samples:
        row = [min(max(current - v, 0), BUCKETS) for v in s.weight_versions] \
            if len(s.weight_versions) == s.response_length else []
        rows.append(row + [-1] * (width - len(row)))
    return torch.tensor(rows, dtype=torch.long)


def lag_kl_sums(samples: Sequence[Sample], current: int, logprobs: torch.Tensor, rollout: torch.Tensor,
                loss_mask: torch.Tensor) -> dict[str, float]:
    """Per lag bucket: the sum of k3(μ ‖ π) over the loss-carrying tokens of one micro-batch, and their count.

    `logprobs` (π), `rollout` (μ) and `loss_mask` are [B, T] aligned with `samples`' response tokens, as
    `step.collate` lays them out. Every bucket's two keys are present, so ranks report the same keys."""
    buckets = lag_buckets(samples, current, logprobs.shape[1]).to(logprobs.device)
    valid = (loss_mask > 0) & (buckets >= 0)
    log_ratio = torch.where(valid, logprobs.detach().double() - rollout.double(), 0.0)
    k3 = torch.expm1(log_ratio) - log_ratio
    sums: dict[str, float] = {}
    for k, label in enumerate(LABELS):
        chosen = valid & (buckets == k)
        sums[_KL_SUM + label] = float(k3[chosen].sum())
        sums[_KL_TOKENS + label] = float(chosen.sum())
    return sums


def lag_kl_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` with the summed `lag_kl_sums` keys replaced by `version_lag_kl/<k>` means (empty buckets left
    out)."""
    out = {k: v for k, v in metrics.items() if not k.startswith((_KL_SUM, _KL_TOKENS))}
    for label in LABELS:
        tokens = metrics.get(_KL_TOKENS + label, 0.0)
        if tokens > 0:
            out[f"version_lag_kl/{label}"] = metrics[_KL_SUM + label] / tokens
    return out
