"""job=train end to end on the tiny model: weights reach the engine, versions reach the samples, resume
reproduces an uninterrupted run, W&B logs offline, and a two-value learning-rate sweep runs.

Real parts throughout: embedded engine, gateway, subprocess agents (the default digits task), torch
trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run

SMALL = ["rollout.batch_size=2", "rollout.n_samples_per_prompt=4", "rollout.max_response_len=8",
         "trainer.optim.lr=5e-3"]


def train_config(out: Path, tiny_path: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "job=train", f"output_dir={out}", f"model.cache_dir={tiny_path.parent}",
            f"debug.save_rollout_data={out}/dump/r_{{rollout_id}}.jsonl", *SMALL, *overrides,
        ]))


def dump(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "dump" / f"r_{step}.jsonl").read_text().splitlines()]


def test_two_steps_push_weights_and_versions_reach_the_samples(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(train_config(tmp_path, tiny_path, "rollout.num_steps=2"))
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "perf/step_time", "perf/train_time",
                "rollout/raw_reward"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))
    assert metrics["train/weight_version"] == 2
    assert metrics["engine/decode_s"] > 0 and metrics["engine/prefill_s"] > 0 and metrics["perf/weight_sync_s"] > 0
    generated_rows = [r for r in dump(tmp_path, 1) if r["status"] in ("completed", "truncated")]
    assert metrics["engine/generated_tokens"] >= sum(r["response_length"] > 0 for r in generated_rows)
    first, second = dump(tmp_path, 0), dump(tmp_path, 1)
    assert all(set(r["weight_versions"]) == {0} for r in first if r["status"] == "completed")
    generated = [v for r in second for v, m in zip(r["weight_versions"], r["loss_mask"], strict=True) if m]
    assert generated and set(generated) == {1}
    assert metrics["train/version_lag/0"] == 1.0 and metrics["train/version_lag/mean"] == 0.0, "sync: no lag"
    log = (tmp_path / "run.log").read_text()
    assert "rollout/raw_reward first step" in log and "checkpoint saved" in log


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    latest = max((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return load_file(next(latest.rglob("*.safetensors")))


def test_resume_equals_an_uninterrupted_run(tmp_path: Path, tiny_path: Path) -> None:
    """Same seed, same results: sampling seeds come from (seed, step, prompt, session, turn), the data
    position and weights come from the checkpoint; one request per engine batch and no prefix cache keep
    logprobs bit-identical whichever requests share a batch or a cached prefix (a cached prefix's KV is
    computed in another shape, equal only to float rounding)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    exact = ("engine.max_batch_size=1", "engine.kv_cache_mb=0", "rollout.batch_size=1")
    run(train_config(straight, tiny_path, "rollout.num_steps=3", *exact))
    run(train_config(resumed, tiny_path, "rollout.num_steps=2", *exact))
    run(train_config(resumed, tiny_path, "rollout.num_steps=3", "trainer.resume=true", *exact))
    assert [r["tokens"] for r in dump(straight, 2)] == [r["tokens"] for r in dump(resumed, 2)]
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_wandb_logs_offline_into_the_output_folder(tmp_path: Path, tiny_path: Path, monkeypatch) -> None:  # noqa: ANN001
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(train_config(tmp_path, tiny_path, "job=rollout", "rollout.num_steps=1", "tracking=wandb"))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_learning_rate_sweep_runs_each_job_in_its_own_folder(tmp_path: Path, tiny_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "relax_pipeline", "-m", "trainer.optim.lr=1e-3,3e-3", "rollout.num_steps=2", *SMALL[:3],
         f"model.cache_dir={tiny_path.parent}", f"hydra.sweep.dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        log = (tmp_path / job / "run.log").read_text()
        assert "train/loss" in log and "rollout/raw_reward first step" in log
