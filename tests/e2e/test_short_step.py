"""A step whose every group is filtered goes on short and says how many groups it started: the first groups
plus every replacement, up to `MAX_STARTS_PER_NEED` per needed group (the audit found the replacements uncounted).
Real agents, engine and gateway."""

from __future__ import annotations

import json
from pathlib import Path

from test_e2e_rollout import compose_config

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
