"""`credit.metrics_path`: the user's metrics of a train step's rows (credit/user_metrics.py)."""

from __future__ import annotations

import asyncio
import logging

import credit_hooks
import pytest

from relax_pipeline.credit.reward import RewardCredit
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.credit.user_metrics import UserMetrics

ROWS = [{"status": "completed", "reward": 1.0}, {"status": "failed", "reward": None}]


def metrics(path: str | None) -> dict[str, float]:
    return asyncio.run(UserMetrics(path)(ROWS))


def test_the_hook_sees_copies_of_the_rows_and_its_metrics_are_prefixed() -> None:
    credit_hooks.CALLS.clear()
    assert metrics("credit_hooks.metrics_of_rows") == {"rollout/user/rows": 2.0, "rollout/user/completed": 1.0}
    assert ROWS[0]["status"] == "completed", "the hook edited a copy"
    assert credit_hooks.CALLS[0][1] == ROWS[1]


def test_async_hooks_are_awaited_and_no_path_calls_nothing() -> None:
    assert metrics("credit_hooks.metrics_async") == {"rollout/user/rows": 2.0}
    assert metrics(None) == {}


@pytest.mark.parametrize("hook, fragment", [("metrics_not_a_dict", "must return a dict"),
                                            ("metrics_nan", "'bad'=nan is not finite"),
                                            ("metrics_raises", "RuntimeError: boom")])
def test_a_bad_hook_is_counted_and_logged_naming_it(hook: str, fragment: str, caplog: pytest.LogCaptureFixture
                                                   ) -> None:
    with caplog.at_level(logging.WARNING):
        assert metrics(f"credit_hooks.{hook}") == {"rollout/user/errors": 1.0}
    assert f"credit.metrics_path='credit_hooks.{hook}' failed" in caplog.text and fragment in caplog.text


def test_a_path_that_does_not_import_fails_at_start_naming_the_key() -> None:
    with pytest.raises(ValueError, match="credit.metrics_path='credit_hooks.nope': module 'credit_hooks' has no"):
        RewardCredit(CreditSettings(metrics_path="credit_hooks.nope"))
