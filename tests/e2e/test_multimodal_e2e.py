"""Multimodal end to end: a dataset row with two images, through a real agent process, to the rollout dump.

Real parts throughout: the tiny VL model in the embedded engine, the gateway, the minimal OpenAI-SDK agent
as a subprocess (it forwards the input messages, image parts included), the dump. The dump row's training
ids must be processor-expanded (as many image-pad tokens as `image_grid_thw` implies), keep the docs/design.md §3.4
invariants, and score its generated tokens exactly as the trainer's forward with the same pixels does.
`job=train model=tiny_vl` (slow) shows the trainer feeds `multimodal_train_inputs` and moves the weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_e2e_rollout import FIELDS, compose_config, read_dump

from relax_pipeline.canonical.form import image_of
from relax_pipeline.config import REPO_ROOT
from relax_pipeline.data.media import image_url
from relax_pipeline.engine.vision import Vision
from relax_pipeline.forest.sample import Sample
from relax_pipeline.run import run
from relax_pipeline.testing.engines import RecordingHFEngine
from relax_pipeline.train.step import collate, response_logprobs
from relax_pipeline.train.torch_backend import load_policy

MAKE_DATASET = REPO_ROOT / "examples" / "multimodal" / "make_dataset.py"
REWARD_AGENT = """import json, os, openai
task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
client = openai.OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
reply = client.chat.completions.create(model="m", messages=task["messages"]).choices[0].message.content or ""
json.dump({"reward": float(len(reply) % 3)}, open(os.environ["RELAX_OUTPUT_JSON"], "w"))
"""


def image_dataset(folder: Path, rows: int) -> Path:
    subprocess.run([sys.executable, str(MAKE_DATASET), str(folder), str(rows)], check=True, capture_output=True)
    return folder / "data.jsonl"


def vl_overrides(data: Path, tiny_vl_path: Path) -> list[str]:
    return ["model=tiny_vl", f"model.cache_dir={tiny_vl_path.parent}", f"dataset.path={data}",
            "+dataset.multimodal_keys.image=images"]


def test_two_images_reach_the_dump_as_expanded_training_ids(tmp_path: Path, tiny_vl_path: Path) -> None:
    data = image_dataset(tmp_path / "data", rows=1)
    cfg = compose_config(tmp_path, tiny_vl_path, "agent=single_turn", "rollout.batch_size=1",
                         "engine._target_=relax_pipeline.testing.engines.RecordingHFEngine",
                         *vl_overrides(data, tiny_vl_path))
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    vision = Vision.load(tiny_vl_path)
    assert vision is not None and len(rows) == 2
    features = [vision.features(image_of(image_url(p), 0, "p")) for p in sorted((data.parent / "images").glob("*"))]
    for row in rows:
        check_expanded_row(row, vision.image_token_id, [f.grid_thw for f in features])
        assert logprobs_of(row, tiny_vl_path, features) == pytest.approx(generated(row), abs=1e-4)
    engine = RecordingHFEngine.last
    assert engine is not None and [len(m) for m in engine.media] == [2, 2]
    assert all(prompt.count(vision.image_token_id) == 2 for prompt, _ in engine.calls), "inference ids unexpanded"
    sent = json.loads(next((tmp_path / "sessions").rglob("input.json")).read_text())["messages"][0]["content"]
    assert [p["type"] for p in sent] == ["text", "image_url", "text", "image_url"]
    assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in sent if p["type"] == "image_url")


def check_expanded_row(row: dict, pad: int, grids: list[tuple[int, int, int]]) -> None:
    """docs/design.md §3.4 invariants, plus training ids expanded exactly as image_grid_thw implies (merge 2×2)."""
    assert set(row) == FIELDS | {"multimodal"} and row["status"] in ("completed", "truncated")
    assert row["multimodal"]["image_grid_thw"] == [list(g) for g in grids]
    expected = [t * h * w // 4 for t, h, w in grids]
    assert row["multimodal"]["image_tokens"] == expected and row["tokens"].count(pad) == sum(expected) == 12 + 25
    assert row["tokens"][: row["prompt_length"]].count(pad) == sum(expected), "images sit in the prompt"
    n = row["response_length"]
    assert len(row["tokens"]) == row["prompt_length"] + n
    assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["weight_versions"]) == n
    for mask, logprob in zip(row["loss_mask"], row["rollout_logprobs"], strict=True):
        assert (logprob == 0.0) if mask == 0 else (logprob <= 0.0)
    user = row["messages"][0]["content"]
    assert [p["type"] for p in user] == ["text", "image_url", "text", "image_url"]
    assert all(p["image_url"]["url"].startswith("data:elided;blake2b=") for p in user if p["type"] == "image_url")


def generated(row: dict) -> list[float]:
    return [lp for lp, m in zip(row["rollout_logprobs"], row["loss_mask"], strict=True) if m]


def logprobs_of(row: dict, model_path: Path, features: list) -> list[float]:
    """The trainer's logprobs of the row's generated tokens, with the images as multimodal_train_inputs."""
    inputs = {"pixel_values": torch.cat([f.pixel_values for f in features]),
              "image_grid_thw": torch.tensor([list(f.grid_thw) for f in features])}
    sample = Sample(tuple(row["tokens"]), row["prompt_length"], tuple(row["loss_mask"]),
                    tuple(row["rollout_logprobs"]), advantage=0.0, multimodal_train_inputs=inputs)
    model, pad_id = load_policy(str(model_path), 0, "cpu")
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, collate([sample], pad_id, "cpu"), temperature=1.0)
    return [float(lp) for lp, m in zip(logprobs[0], row["loss_mask"], strict=True) if m]


@pytest.mark.slow
def test_train_steps_on_tiny_vl_move_the_vision_weights(tmp_path: Path, tiny_vl_path: Path) -> None:
    data = image_dataset(tmp_path / "data", rows=2)
    agent = tmp_path / "reward_agent.py"
    agent.write_text(REWARD_AGENT)
    cfg = compose_config(tmp_path, tiny_vl_path, "job=train", "rollout.num_steps=2", "rollout.n_samples_per_prompt=4",
                         "trainer.optim.lr=5e-3", f"agent.command='{sys.executable} {agent}'",
                         *vl_overrides(data, tiny_vl_path))
    metrics = run(cfg)
    assert metrics["train/weight_version"] == 2 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    from safetensors.torch import load_file

    before = load_policy(str(tiny_vl_path), 0, "cpu")[0].state_dict()
    after = load_file(str(next((tmp_path / "checkpoints").glob("step_2")) / "model.safetensors"))
    moved = [k for k in after if k.startswith("model.visual") and not torch.equal(after[k], before[k])]
    assert moved, "gradients reached the vision tower through the image embeddings"
