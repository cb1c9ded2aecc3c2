"""Whole runs with `engine.admission=program`: on the embedded engine, and on two launched SGLang-wire fakes
behind the real smg; the `agentic_kv/*` metrics reach the step's metrics, and every session that
ended returned its lease (the turn service's `close_session`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_pipeline.run import run
from tests.e2e.test_e2e_rollout import compose_config


def check(metrics: dict[str, float]) -> None:
    assert metrics["agentic_kv/admitted"] >= 4, "every session of the step was admitted"
    assert metrics["agentic_kv/fail_open"] == 0 and metrics["agentic_kv/capacity"] > 0
    assert metrics["agentic_kv/actual_tokens"] > 0 and metrics["agentic_kv/predicted_tokens"] > 0
    assert metrics["agentic_kv/leased_tokens"] == 0, "ended sessions hold no lease"


def test_the_embedded_engine_admits_the_steps_sessions(tmp_path: Path, tiny_path: Path) -> None:
    check(run(compose_config(tmp_path, tiny_path, "engine.admission=program")))


def test_sglang_servers_behind_the_router_admit_the_steps_sessions(tmp_path: Path, tiny_path: Path) -> None:
    pytest.importorskip("smg", reason="pip install -e '.[router]' (smg, the router binary)")
    from tests.e2e.test_sglang_e2e import sglang_overrides

    metrics = run(compose_config(tmp_path, tiny_path, *sglang_overrides("max_total_num_tokens=2000"),
                                 "engine.admission=program"))
    check(metrics)
    assert metrics["agentic_kv/capacity"] == 4000, "two servers' max_total_num_tokens"
