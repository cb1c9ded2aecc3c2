"""Weight-version provenance (train/provenance.py): shares of a step's trained tokens by lag, and the KL from the
sampling policy to the current one per lag bucket, on known versions and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.provenance import lag_kl_metrics, lag_kl_sums, version_lag


def sample(versions: tuple[int, ...], mask: tuple[int, ...]) -> Sample:
    return Sample((1,) * (1 + len(mask)), 1, mask, (0.0,) * len(mask), versions, advantage=0.0)


def test_shares_count_only_loss_tokens_at_their_lag_behind_the_current_version() -> None:
    samples = [sample((5, 5, 4, 4), (1, 1, 0, 1)),  # lags 0, 0, -, 1
               sample((3, 0, 0), (1, 1, 1))]  # lags 2, 5, 5 (4+)
    got = version_lag(samples, current=5)
    assert got == pytest.approx({"train/version_lag/0": 2 / 6, "train/version_lag/1": 1 / 6,
                                 "train/version_lag/2": 1 / 6, "train/version_lag/3": 0.0,
                                 "train/version_lag/4+": 2 / 6, "train/version_lag/mean": (0 + 0 + 1 + 2 + 5 + 5) / 6})


def test_a_sync_step_is_all_lag_zero_and_unversioned_samples_report_nothing() -> None:
    assert version_lag([sample((2, 2), (1, 1))], current=2)["train/version_lag/0"] == 1.0
    assert version_lag([sample((), (1, 1))], current=2) == {}


def kl3(log_ratio: float) -> float:
    """k3 of one token: r - 1 - log r with log r = log π - log μ."""
    return math.expm1(log_ratio) - log_ratio


def test_kl_per_lag_bucket_is_the_k3_mean_of_each_buckets_loss_tokens() -> None:
    """Known lags and logprobs: the policy's logprob differs from the sampler's by a known amount per token."""
    samples = [sample((5, 5, 4, 4), (1, 1, 0, 1)),  # lags 0, 0, - (mask 0), 1
               sample((3, 0, 0), (1, 1, 1))]  # lags 2, 5, 5 (4+)
    rollout = torch.tensor([[-1.0, -2.0, 0.0, -1.5], [-0.5, -3.0, -2.0, 0.0]])
    policy = rollout + torch.tensor([[0.1, -0.2, 9.0, 0.3], [-0.4, 0.5, 0.25, 7.0]])  # 9.0 and 7.0 never count
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    got = lag_kl_metrics(lag_kl_sums(samples, 5, policy, rollout, mask))
    assert got == pytest.approx({"version_lag_kl/0": (kl3(0.1) + kl3(-0.2)) / 2, "version_lag_kl/1": kl3(0.3),
                                 "version_lag_kl/2": kl3(-0.4), "version_lag_kl/4+": (kl3(0.5) + kl3(0.25)) / 2},
                                rel=1e-6)
    assert "version_lag_kl/3" not in got, "a bucket without tokens is left out, not reported as 0"


def test_kl_sums_add_over_micro_batches_and_unversioned_samples_count_nowhere() -> None:
    first = lag_kl_sums([sample((2,), (1,))], 2, torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.ones(1, 1))
    second = lag_kl_sums([sample((), (1,))], 2, torch.tensor([[-1.0]]), torch.tensor([[-3.0]]), torch.ones(1, 1))
    summed = {k: first[k] + second[k] for k in first}
    assert lag_kl_metrics({**summed, "loss": 1.0}) == pytest.approx({"loss": 1.0, "version_lag_kl/0": kl3(0.5)})
