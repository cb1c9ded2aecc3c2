"""LangChain (examples/harnesses/langchain_agent.py, `agent=langchain`) unchanged through the pipeline:
`create_agent` on ChatOpenAI (Chat Completions and Responses) and ChatAnthropic (Messages), each streaming
and not, driven through two bash tool calls and an answer."""

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
GATEWAY_API = {"chat": "chat", "responses": "responses", "anthropic": "messages"}


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
def test_langchain_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path, api: str, stream: bool) -> None:
    skip_unless("langchain", "langchain_openai", "langchain_anthropic")
    result = run_harness(tmp_path, tiny_path, "langchain", SCRIPT, f"agent.env.LANGCHAIN_API={api}",
                         f"agent.env.LANGCHAIN_STREAM={int(stream)}")
    assert set(apis(result)) == {(GATEWAY_API[api], stream)}
    for row in check_run(result):
        assert row["turn_count"] == 3
        assert row["messages"][-1]["content"] == "The answer is 6."
