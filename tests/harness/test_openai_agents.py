"""openai-agents (examples/harnesses/openai_agents.py, `agent=openai_agents`) unchanged through the pipeline:
Chat Completions and Responses, each streaming and not, driven through two bash tool calls and an answer."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness_run import apis, check_run, run_harness, skip_unless

SCRIPT = [
    {"tool_calls": [{"name": "bash", "arguments": {"command": "echo 11 - 5 | bc"}}]},
    {"reasoning": "bc said 6; check it once more.", "tool_calls": [{"name": "bash",
                                                                   "arguments": {"command": "expr 11 - 5"}}]},
    {"content": "The answer is 6."},
]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path, api: str, stream: bool) -> None:
    skip_unless("agents")
    result = run_harness(tmp_path, tiny_path, "openai_agents", SCRIPT, f"agent.env.OPENAI_AGENTS_API={api}",
                         f"agent.env.OPENAI_AGENTS_STREAM={int(stream)}")
    for row in check_run(result):
        assert row["turn_count"] == 3
        assert row["messages"][-1]["content"] == "The answer is 6."
    assert set(apis(result)) == {(api, stream)}
