"""The step's accounting line: a step whose every group is filtered goes on short and says how many groups it
started, the first groups plus every replacement, up to `MAX_STARTS_PER_NEED` per needed group (the audit found
the replacements uncounted); `samples=` counts only rows with credit, and rows without credit are counted apart
(`uncredited=`; the audit found them counted as samples). Real agents, engine and gateway."""

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


def test_rows_without_credit_are_not_counted_as_samples(tmp_path: Path, tiny_path: Path) -> None:
    """The minimal agent with its reward file pointed elsewhere: every session exports no reward."""
    agent = f"{sys.executable} {REPO_ROOT}/examples/minimal_agent/agent.py"
    cfg = compose_config(tmp_path, tiny_path, "agent=single_turn", "rollout.max_response_len=2",
                         f"agent.command='RELAX_OUTPUT_JSON=/dev/null {agent}'")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "dump" / "r_0.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] in ("completed", "truncated") and r["advantage"] is None for r in rows)
    assert "samples=0 uncredited=4" in (tmp_path / "run.log").read_text()
