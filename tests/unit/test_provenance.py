"""Weight-version provenance (train/provenance.py): shares of a step's trained tokens by lag, on known versions."""

from __future__ import annotations

import pytest

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.provenance import version_lag


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
