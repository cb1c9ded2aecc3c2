"""Metrics that tell the truth about the policy under a group filter, end to end: `rollout/sampled_reward` and
`rollout/sampled_passrate` cover every scored group (kept or filtered), `rollout/kept_fraction` says how many
were kept, filtered rows in the dump keep the reward they were scored with (advantage null), and the tokens
generated in filtered or surplus groups are logged as `rollout/wasted_tokens`. Real agents, engine, gateway.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run


def test_sampled_metrics_cover_filtered_groups_and_filtered_rows_keep_their_reward(tmp_path: Path,
                                                                                    tiny_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"input": f"Add {i} and {i}; reply in digits.", "metadata": {"answer": 2 * i, "flaky": i < 2}}
            for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=rollout", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=false", "rollout.num_steps=1", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
            "rollout.over_sampling_batch_size=3", "rollout.max_response_len=4", "credit.log_passrate=true",
            "credit.filter_path=credit_hooks.reject_first_sight_of_flaky",
            f"debug.save_rollout_data={tmp_path}/r_{{rollout_id}}.jsonl",
        ]))
    metrics = run(cfg)
    step = [json.loads(line) for line in (tmp_path / "r_0.jsonl").read_text().splitlines()]
    kept = [r for r in step if r["status"] in ("completed", "truncated")]
    filtered = [r for r in step if r["status"] == "filtered"]
    assert len(filtered) >= 4, "both flaky prompts are filtered the first time"
    assert all(isinstance(r["reward"], float) and r["advantage"] is None and r["error"] is None for r in filtered)
    groups = {status: len({r["group_id"] for r in step if r["status"] in statuses})
              for status, statuses in (("kept", ("completed", "truncated")), ("filtered", ("filtered",)))}
    assert metrics["rollout/kept_fraction"] == groups["kept"] / (groups["kept"] + groups["filtered"])
    assert metrics["rollout/raw_reward"] == statistics.fmean(r["reward"] for r in kept)
    assert metrics["rollout/sampled_reward"] == statistics.fmean(r["reward"] for r in kept + filtered)
    assert metrics["rollout/sampled_passrate"] == statistics.fmean(r["reward"] == 1 for r in kept + filtered)
    assert metrics["rollout/wasted_tokens"] >= len(filtered), "every filtered session generated tokens"
    assert "rollout/sampled_reward=" in (tmp_path / "run.log").read_text()
