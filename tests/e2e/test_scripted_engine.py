"""`engine=scripted engine.script=PATH` from the CLI config: script lines become real template tokens, every
session replays the script from its first line, and the output parser reads back what was scripted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e_rollout import check_row, compose_config, read_dump

from relax_pipeline.run import run
from relax_pipeline.testing.script_engine import read_script

SCRIPT = [
    {"reasoning": "I should use the calculator.", "tool_calls": [{"name": "calculator",
                                                                   "arguments": {"expression": "1 + 2"}}]},
    {"content": "The answer is 3."},
]


def write_script(folder: Path, lines: list) -> Path:
    path = folder / "script.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_scripted_run_records_real_tokens_for_every_session(tmp_path: Path, tiny_path: Path) -> None:
    script = write_script(tmp_path, SCRIPT)
    metrics = run(compose_config(tmp_path, tiny_path, "engine=scripted", f"engine.script={script}",
                                 "+agent.env.MINIMAL_AGENT_TURNS=3", "rollout.max_response_len=64"))
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and metrics["rollout/dropped_groups"] == 0
    for row in rows:
        check_row(row)
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        assert assistant[0]["reasoning_content"] == "I should use the calculator."
        call = assistant[0]["tool_calls"][0]["function"]
        assert call["name"] == "calculator" and json.loads(call["arguments"]) == {"expression": "1 + 2"}
        assert assistant[1]["content"] == "The answer is 3." and assistant[2]["content"] == "done."
        assert row["turn_count"] == 3 and row["reward"] == 0.0, "the last answer, done., names no number"


def test_a_bad_script_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"content": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a script line is a JSON object with keys among"):
        read_script(path)
    with pytest.raises(FileNotFoundError, match="engine.script="):
        read_script(tmp_path / "missing.jsonl")
