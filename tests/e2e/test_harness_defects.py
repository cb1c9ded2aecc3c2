"""Whole runs for the interop defects that end in the pipeline rather than the gateway: an agent that fails
after our length limit cut its turn is recorded as truncated, a run that never trains fails, and the context
limit defaults to the model's own maximum."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_e2e_rollout import compose_config, read_dump

from relax_pipeline.config import REPO_ROOT
from relax_pipeline.run import run

STOPS_ON_LENGTH = REPO_ROOT / "tests" / "agents" / "stops_on_length.py"


def test_an_agent_failing_after_a_length_cut_is_truncated_not_failed(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, f"agent.command='{sys.executable} {STOPS_ON_LENGTH}'",
                         "rollout.max_response_len=3", "credit.truncated_reward=0.25")
    metrics = run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and {r["status"] for r in rows} == {"truncated"}
    assert all(r["reward"] == 0.25 and r["response_length"] == 3 and r["outcome"] == "truncated" for r in rows)
    assert all("exited with code 3" in r["error"] and "finish_reason=length" in r["error"] for r in rows), \
        "the failure after the cut stays in the row"
    assert metrics["rollout/truncated_ratio"] == 1.0 and metrics["rollout/dropped_groups"] == 0
    assert "recorded as truncated" in (tmp_path / "run.log").read_text()


def test_a_training_run_that_never_trains_fails_naming_why(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, "job=train", "agent.command='exit 1'", "rollout.batch_size=1")
    with pytest.raises(ValueError, match="trained on 0 samples"):
        run(cfg)
    log = (tmp_path / "run.log").read_text()
    assert "step 0: trained on 0 samples" in log and "run failed: every one of the 1 steps" in log


def test_the_context_limit_defaults_to_the_models_maximum(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(compose_config(tmp_path, tiny_path, "job=check"))
    assert metrics["check/problems"] == 0.0
    assert "check: max_context_len = 4096" in (tmp_path / "run.log").read_text()
