"""Group filter + over-sampling under runtime=sync: the step still delivers rollout.batch_size groups,
filtered groups are replaced within the step and recorded, surplus groups are terminated and recorded,
and no prompt is lost: filtered and surplus prompts go back to the data source and are served first, so a
small dataset is fully trained on (4 prompts, 4 steps of 2 groups). Real agents, engine and gateway.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run


def test_filtered_groups_are_replaced_and_every_prompt_is_covered(tmp_path: Path, tiny_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [{"input": f"What is {i} + {i}? Reply with digits only.", "metadata": {"answer": 2 * i, "flaky": i < 2}}
            for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=rollout", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=false", "rollout.num_steps=4", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
            "rollout.over_sampling_batch_size=3", "rollout.max_response_len=4",
            "credit.filter_path=credit_hooks.reject_first_sight_of_flaky",
            f"debug.save_rollout_data={tmp_path}/r_{{rollout_id}}.jsonl",
        ]))
    metrics = run(cfg)
    steps = [[json.loads(line) for line in (tmp_path / f"r_{i}.jsonl").read_text().splitlines()] for i in range(4)]
    trained: Counter[int] = Counter()
    for step in steps:
        completed = {r["group_id"] for r in step if r["status"] in ("completed", "truncated")}
        assert len(completed) == 2, "each step delivers rollout.batch_size groups"
        trained.update(int(g.split("-")[1]) for g in completed)
        assert all(r["error"] for r in step if r["status"] == "dropped")
        assert all(r["error"] is None for r in step if r["status"] == "filtered")
    assert set(trained) == {0, 1, 2, 3}, f"every prompt is trained on: {trained}"
    first = Counter(r["status"] for r in steps[0])
    assert first["filtered"] >= 2 and first["completed"] + first["truncated"] == 4
    surplus = [r for step in steps for r in step if r["status"] == "dropped"]
    assert all(r["error"].startswith("surplus") for r in surplus)
    assert metrics["rollout/dropped_groups"] == len({r["group_id"] for r in steps[3] if r["status"] == "dropped"})
