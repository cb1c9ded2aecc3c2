"""examples/deepeyes_agentic without a server: the committed dataset regenerates byte for byte, its labels sit
inside their shapes, and the `crop` tool validates, clamps and answers with an image part (or an error text)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

from relax_pipeline.config import REPO_ROOT
from relax_pipeline.data.media import load_image

EXAMPLE = REPO_ROOT / "examples" / "deepeyes_agentic"
DATA = EXAMPLE / "data"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deepeyes_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def agent() -> ModuleType:
    return load("agent")


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_regenerating_the_committed_dataset_gives_the_same_bytes(tmp_path: Path) -> None:
    load("make_data").write_dataset(0, tmp_path)
    committed, fresh = files(DATA), files(tmp_path)
    assert sorted(fresh) == sorted(committed) and len(committed) == 2 + 16 + 8
    changed = [name for name in committed if committed[name] != fresh[name]]
    assert not changed, f"rerun: python examples/deepeyes_agentic/make_data.py 0 {DATA} (differs: {changed[:3]})"
    assert sum(len(b) for b in committed.values()) < 200_000


def test_every_row_asks_about_a_label_inside_its_shape() -> None:
    for split, rows in (("train", 16), ("test", 8)):
        lines = [json.loads(line) for line in (DATA / f"{split}.jsonl").read_text().splitlines()]
        assert len(lines) == rows
        for row in lines:
            meta = row["metadata"]
            label, shape = meta["label_box"], meta["shape_box"]
            assert shape[0] < label[0] < label[2] < shape[2] and shape[1] < label[1] < label[3] < shape[3]
            assert row["input"].count("<image>") == len(row["images"]) == 1 and len(meta["answer"]) == 2
            assert Image.open(DATA / row["images"][0]).size == (224, 224)


@pytest.mark.parametrize(("arguments", "box"), [
    ('{"x0": 10, "y0": 20, "x1": 80, "y1": 90}', (10, 20, 80, 90)),
    ('{"x0": 0.5, "y0": 0, "x1": 1, "y1": 0.25}', (112, 0, 224, 56)),
    ('{"x0": 300, "y0": -5, "x1": 100, "y1": 40.4}', (100, 0, 224, 40)),
    ('{"bbox": [1, 2, 30, 40]}', (1, 2, 30, 40)),
])
def test_crop_boxes_are_pixels_or_fractions_clamped_to_the_image(agent: ModuleType, arguments: str,
                                                                 box: tuple[int, ...]) -> None:
    assert agent.parse_box(arguments, 224, 224) == box


@pytest.mark.parametrize(("arguments", "error"), [
    ("{x0: 1", "arguments must be JSON"),
    ('{"x0": 1, "y0": 2, "x1": 3}', "four numbers"),
    ('{"x0": "left", "y0": 2, "x1": 30, "y1": 40}', "four numbers"),
    ('{"x0": true, "y0": 0, "x1": 1, "y1": 1}', "four numbers"),
    ("[1, 2, 3, 4]", "four numbers"),
    ('{"x0": 10, "y0": 10, "x1": 12, "y1": 90}', "smaller than 4 pixels"),
    ('{"x0": 500, "y0": 0, "x1": 600, "y1": 50}', "smaller than 4 pixels"),
])
def test_bad_crop_arguments_raise_a_tool_error_saying_what_to_fix(agent: ModuleType, arguments: str,
                                                                  error: str) -> None:
    with pytest.raises(agent.ToolError, match=error):
        agent.parse_box(arguments, 224, 224)


def call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_crop_comes_back_as_an_enlarged_image_part(agent: ModuleType) -> None:
    image = Image.open(DATA / "images" / "train_000.png").convert("RGB")
    message, box = agent.tool_message(call("crop", '{"x0": 148, "y0": 124, "x1": 204, "y1": 152}'), image)
    assert box == (148, 124, 204, 152) and message["role"] == "tool" and message["tool_call_id"] == "call_1"
    text, part = message["content"]
    assert text == {"type": "text", "text": "crop [148, 124, 204, 152] enlarged:"}
    zoomed = load_image(part["image_url"]["url"])
    assert part["type"] == "image_url" and zoomed.size == (224, 112)
    assert zoomed.getpixel((0, 0)) == image.getpixel((148, 124))


def test_bad_calls_get_a_text_answer_and_no_box(agent: ModuleType) -> None:
    image = Image.open(DATA / "images" / "train_000.png").convert("RGB")
    message, box = agent.tool_message(call("crop", "not json"), image)
    assert box is None and message["content"].startswith("error: arguments must be JSON")
    message, box = agent.tool_message(call("zoom", "{}"), image)
    assert box is None and "the only tool is crop" in message["content"]


@pytest.mark.parametrize(("reply", "normal"), [("55", "55"), (" Answer: 55. ", "55"), ("The answer is 55", "55"),
                                               ("5 5", "5 5"), ("", "")])
def test_answers_are_normalized_before_the_exact_match(agent: ModuleType, reply: str, normal: str) -> None:
    assert agent.normalize(reply) == normal
