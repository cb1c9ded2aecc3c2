"""examples/search_r1 without a server: the committed data regenerates byte for byte from its seed, every question
has its answer in the corpus, and the agents' answer extraction, normalization and bad-tool-call handling."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from relax_pipeline.config import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "search_r1"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"search_r1_{name}", EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_data_is_what_make_data_0_writes(tmp_path: Path) -> None:
    written = load("make_data").write(0, tmp_path)
    assert [p.name for p in written] == ["corpus.jsonl", "train.jsonl", "test.jsonl"]
    for path in written:
        assert path.read_bytes() == (EXAMPLE / "data" / path.name).read_bytes(), (
            f"data/{path.name} differs: regenerate with `cd examples/search_r1 && python make_data.py 0 data`")
    assert sum(p.stat().st_size for p in written) < 300_000


def test_splits_are_disjoint_and_every_answer_is_in_the_corpus() -> None:
    rows = {s: [json.loads(x) for x in (EXAMPLE / "data" / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "test")}
    corpus = (EXAMPLE / "data" / "corpus.jsonl").read_text()
    questions = [{r["metadata"]["question"] for r in rows[s]} for s in ("train", "test")]
    assert len(questions[0]) == 200 and len(questions[1]) == 50 and not questions[0] & questions[1]
    tools = load("search_tools")
    for row in rows["train"] + rows["test"]:
        answer = row["metadata"]["answer"]
        assert tools.normalize(answer) and answer.removeprefix("the ") in corpus
        assert row["metadata"]["question"] in row["input"] and row["metadata"]["hops"] in (1, 2)
    assert any(r["metadata"]["hops"] == 2 for r in rows["train"])
    assert load("make_data").generate(1)["train"] != rows["train"], "another seed, other questions"


@pytest.mark.parametrize(("text", "answer"), [
    ("I searched.\n<answer> The Glass Engine </answer>", "The Glass Engine"),
    ("<answer>one</answer> then <answer>two</answer>", "two"),
    ("thinking...\n\nZanmokmi\n", "Zanmokmi"),
    ("", ""),
    (None, ""),
])
def test_final_answer(text: str | None, answer: str) -> None:
    assert load("search_tools").final_answer(text) == answer


def test_exact_match_normalizes_like_search_r1() -> None:
    em = load("search_tools").exact_match
    assert em("the glass engine.", "The Glass  Engine") == 1.0
    assert em("1873", "1873") == 1.0 and em("18730", "1873") == 0.0 and em("", "") == 0.0


@pytest.mark.parametrize("call", [
    {"id": "c1", "function": {"name": "search", "arguments": "{not json"}},
    {"id": "c1", "function": {"name": "search", "arguments": '{"q": "x"}'}},
    {"id": "c1", "function": {"name": "search", "arguments": '["x"]'}},
    {"id": "c1", "function": {"name": "lookup", "arguments": '{"query": "x"}'}},
    {"id": "c1"},
])
def test_a_bad_tool_call_gets_a_tool_message_saying_what_to_fix(call: dict) -> None:
    message, found = load("search_tools").tool_message(call)
    assert message["role"] == "tool" and message["tool_call_id"] == "c1" and found == ""
    assert message["content"].startswith('error: call search with JSON arguments {"query"')
