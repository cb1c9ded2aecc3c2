"""The step's accounting line: a step whose every group is filtered goes on short and says how many groups it
started, the first groups plus every replacement, up to `MAX_STARTS_PER_NEED` per needed group (the audit found
the replacements uncounted); `samples=` counts only rows with credit, and rows without credit are counted apart
(`uncredited=`; the audit found them counted as samples), and a train session that ends without a reward fails
naming the fix instead of passing untrained. Real agents, engine and gateway."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from test_e2e_rollout import compose_config

from relax_pipeline.config import REPO_ROOT
from relax_pipeline.run import run
from relax_pipeline.scheduling.sync import MAX_STARTS_PER_NEED


def test_short_step_counts_every_start(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, "rollout.batch_size=1", "rollout.n_samples_per_prompt=1",
                         "rollout.max_response_len=2", "credit.filter_path=credit_hooks.reject_all")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "dump" / "r_0.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["filtered"] * MAX_STARTS_PER_NEED
    log = (tmp_path / "run.log").read_text()
    assert f"only 0 of 1 groups after {MAX_STARTS_PER_NEED} starts" in log


def test_a_train_session_without_a_reward_fails_naming_the_fix(tmp_path: Path, tiny_path: Path) -> None:
    """The minimal agent with its reward file pointed elsewhere exports no reward, and the run has no reward model:
    each group is dropped with that reason (the audit found such sessions passing silently, trained on nothing)."""
    agent = f"{sys.executable} {REPO_ROOT}/examples/minimal_agent/agent.py"
    cfg = compose_config(tmp_path, tiny_path, "agent=single_turn", "rollout.max_response_len=2",
                         "rollout.batch_size=1", f"agent.command='RELAX_OUTPUT_JSON=/dev/null {agent}'")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "dump" / "r_0.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("has no reward" in r["error"] and "credit.rm_path" in r["error"] for r in failed)
    assert not [r for r in rows if r["status"] in ("completed", "truncated")]
    assert "samples=0 uncredited=0" in (tmp_path / "run.log").read_text()
