"""`experiment=deepeyes_agentic` end to end: a vision agent whose `crop` tool answers with an image.

Two runs, each a real gateway and real agent subprocesses (examples/deepeyes_agentic/agent.py, OpenAI SDK):
- the experiment as shipped, two train steps with the real hf engine on `model=tiny_vl` (an untrained model:
  it never calls the tool, so every session ends with reward 0), writing dump rows with the input image;
- `engine=scripted` on `model=tiny_vl`, forcing a broken crop call, a good one and the right answer: the
  tool result's image is recorded in the forest and the dump row's `multimodal` covers both images (the
  input's and the crop's, each expanded to its image-pad tokens), the invariants of docs/design.md §3.4 hold
  and the reward is 1.0.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from test_e2e_rollout import FIELDS, read_dump

from relax_pipeline.canonical.form import Image, digest, image_of
from relax_pipeline.config import CONF_DIR, REPO_ROOT, quote_placeholders, register
from relax_pipeline.data.media import image_url, png_data_uri
from relax_pipeline.engine.vision import Vision
from relax_pipeline.run import run

DATA = REPO_ROOT / "examples" / "deepeyes_agentic" / "data"
BOX = {"x0": 148, "y0": 124, "x1": 217, "y1": 193}
"""The purple square of train row 0, which holds the label "55"."""


def compose_experiment(tmp_path: Path, tiny_vl_path: Path, *overrides: str) -> DictConfig:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "experiment=deepeyes_agentic", f"output_dir={tmp_path}", f"model.cache_dir={tiny_vl_path.parent}",
            f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl", *overrides]))


def check_invariants(row: dict, pad: int) -> None:
    """docs/design.md §3.4: lengths agree, loss only on generated tokens, observation tokens (image pads) at 0.0."""
    assert set(row) == FIELDS | {"multimodal"} and row["status"] in ("completed", "truncated")
    n = row["response_length"]
    assert len(row["tokens"]) == row["prompt_length"] + n
    assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["weight_versions"]) == n
    for token, mask, logprob in zip(row["tokens"][row["prompt_length"]:], row["loss_mask"], row["rollout_logprobs"],
                                    strict=True):
        assert (logprob == 0.0) if mask == 0 else (logprob <= 0.0)
        assert token != pad or mask == 0, "an image pad is never a generated token"
    grids = row["multimodal"]["image_grid_thw"]
    assert row["multimodal"]["image_tokens"] == [t * h * w // 4 for t, h, w in grids]
    assert row["tokens"].count(pad) == sum(row["multimodal"]["image_tokens"])


def test_the_experiment_trains_two_steps_on_the_cpu(tmp_path: Path, tiny_vl_path: Path) -> None:
    metrics = run(compose_experiment(tmp_path, tiny_vl_path))
    assert metrics["train/weight_version"] == 2 and "eval/test/raw_reward" in metrics
    pad = Vision.load(tiny_vl_path).image_token_id
    for step in (0, 1):
        rows = read_dump(tmp_path / "dump" / f"r_{step}.jsonl")
        assert len(rows) == 4
        for row in rows:
            check_invariants(row, pad)
            assert len(row["multimodal"]["image_grid_thw"]) == 1 + row["metadata"]["crops"]
            assert row["reward"] in (0.0, 1.0) and row["messages"][1]["content"][0]["type"] == "image_url"
    assert (tmp_path / "checkpoints" / "step_2").is_dir()


def one_row_dataset(folder: Path) -> Path:
    """Train row 0 alone (its image path made absolute), so one scripted crop box fits every session."""
    row = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])
    row["images"] = [str(DATA / row["images"][0])]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "one.jsonl").write_text(json.dumps(row) + "\n")
    return folder / "one.jsonl"


def write_script(folder: Path) -> Path:
    lines = [{"content": "Let me look.", "tool_calls": [{"name": "crop", "arguments": {"x0": "left"}}]},
             {"content": "Closer.", "tool_calls": [{"name": "crop", "arguments": BOX}]},
             {"content": "55"}]
    (folder / "script.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder / "script.jsonl"


def test_a_crop_result_image_is_recorded_in_the_dump_and_the_answer_scores(tmp_path: Path,
                                                                           tiny_vl_path: Path) -> None:
    data = one_row_dataset(tmp_path / "data")
    cfg = compose_experiment(tmp_path, tiny_vl_path, "job=rollout", "rollout.num_steps=1", "rollout.batch_size=1",
                             "engine=scripted", f"engine.script={write_script(tmp_path)}", f"dataset.path={data}",
                             "rollout.max_response_len=64", "eval.interval=null")
    metrics = run(cfg)
    assert metrics["rollout/raw_reward"] == 1.0 and metrics["crop_hit/mean"] == 1.0
    vision = Vision.load(tiny_vl_path)
    expected = [vision.features(_image(image_url(data.parent / p)))
                for p in json.loads(data.read_text())["images"]] + [vision.features(_image(_crop_uri()))]
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 2
    for row in rows:
        check_invariants(row, vision.image_token_id)
        assert row["reward"] == 1.0 and row["turn_count"] == 3 and row["metadata"]["crops"] == 1
        assert row["multimodal"]["image_grid_thw"] == [list(f.grid_thw) for f in expected]
        prompt, response = row["tokens"][: row["prompt_length"]], row["tokens"][row["prompt_length"]:]
        assert prompt.count(vision.image_token_id) == expected[0].tokens
        assert response.count(vision.image_token_id) == expected[1].tokens, "the crop sits in a tool observation"
        tools = [m for m in row["messages"] if m["role"] == "tool"]
        assert tools[0]["content"].startswith("error: give four numbers")
        part = tools[1]["content"][1]
        assert part["image_url"]["url"] == f"data:elided;blake2b={digest(_crop_uri().encode()).hex()}"


def _agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deepeyes_agent_e2e", DATA.parent / "agent.py")
    assert spec is not None and spec.loader is not None
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    return agent


def _crop_uri() -> str:
    """The data URI the agent sends for BOX: its own crop of the dataset image."""
    agent = _agent()
    image = agent.load_image(image_url(DATA / "images" / "train_000.png"))
    return png_data_uri(agent.crop(image, tuple(BOX.values())))


def _image(url: str) -> Image:
    return image_of(url, 0, "p")
