"""Weight-version provenance of a training step: how old the weights were that sampled its trained tokens.

Every generated token carries the weight version that sampled it (`Sample.weight_versions`, one per response
token). A step trains at the trainer's current `version`; a token's lag is how many versions behind that it was
sampled (0: by the weights being trained). `version_lag` reports, over the step's loss-carrying tokens, the share
at each lag (`train/version_lag/0` .. `/3`, and `/4+` for older), and the mean lag (`train/version_lag/mean`).
Under `runtime=sync` every share is at lag 0; `partial` and `fully_async` mix versions, and these metrics say how
much.

What it does not do: the KL between the sampling and the current policy per lag bucket (that needs the current
policy's logprobs of the tokens; `train/ppo_kl` is the step's overall figure).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from relax_pipeline.forest.sample import Sample

BUCKETS = 4
"""Lags 0 .. BUCKETS - 1 get a share each; older tokens share `BUCKETS+`."""


def version_lag(samples: Sequence[Sample], current: int) -> dict[str, float]:
    """Shares of the loss-carrying tokens by lag behind `current`, and the mean lag; {} when no token says
    its version (samples made by hand)."""
    lags = [current - version for s in samples if len(s.weight_versions) == len(s.loss_mask)
            for mask, version in zip(s.loss_mask, s.weight_versions, strict=True) if mask]
    if not lags:
        return {}
    counts = Counter(min(max(lag, 0), BUCKETS) for lag in lags)
    shares = {f"train/version_lag/{k}": counts[k] / len(lags) for k in range(BUCKETS)}
    shares[f"train/version_lag/{BUCKETS}+"] = counts[BUCKETS] / len(lags)
    return {**shares, "train/version_lag/mean": sum(lags) / len(lags)}
