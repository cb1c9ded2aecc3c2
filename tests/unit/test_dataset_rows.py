"""Dataset rows: a row may carry its task as input, as metadata, or both (the audit found metadata-only rows
refused); a row with neither, or one that is not an object, is refused naming the line and the keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_pipeline.agent.session_io import build_input
from relax_pipeline.data.dataset import JsonlDataset
from relax_pipeline.data.settings import JsonlSettings


def dataset(tmp_path: Path, *rows: object) -> JsonlDataset:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return JsonlDataset(JsonlSettings(str(path)))


def test_a_metadata_only_row_is_a_prompt_whose_input_file_has_only_metadata(tmp_path: Path) -> None:
    prompt = dataset(tmp_path, {"metadata": {"repo": "r1", "task": "fix the test"}}).prompts[0]
    assert prompt.input is None and prompt.metadata == {"repo": "r1", "task": "fix the test"}
    assert build_input(prompt.input, prompt.metadata) == {"metadata": {"repo": "r1", "task": "fix the test"}}


def test_rows_with_input_still_load_with_or_without_metadata(tmp_path: Path) -> None:
    prompts = dataset(tmp_path, {"input": "2+2?"}, {"input": "3+3?", "metadata": {"answer": 6}}).prompts
    assert [(p.input, p.metadata) for p in prompts] == [("2+2?", {}), ("3+3?", {"answer": 6})]


@pytest.mark.parametrize(("row", "message"), [
    ({"other": 1}, r"rows.jsonl:1: row has neither 'input' \(dataset.input_key\) nor a non-empty 'metadata'"),
    ({"metadata": {}}, "nor a non-empty 'metadata'"),
    (["input"], "a row must be a JSON object, got list"),
    ({"input": ""}, "'input' must be a non-empty string or message list"),
    ({"input": "x", "metadata": [1]}, "'metadata' must be an object"),
])
def test_bad_rows_name_the_line_and_the_key(tmp_path: Path, row: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataset(tmp_path, row)
