"""smolagents (examples/harnesses/smolagents_agent.py, `agent=smolagents`) unchanged through the pipeline: a
ToolCallingAgent on Chat Completions, streaming and not, driven through two bash calls and `final_answer`."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness_run import apis, check_run, run_harness, skip_unless

SCRIPT = [
    {"tool_calls": [{"name": "bash", "arguments": {"command": "echo 11 - 5 | bc"}}]},
    {"tool_calls": [{"name": "bash", "arguments": {"command": "expr 11 - 5"}}]},
    {"tool_calls": [{"name": "final_answer", "arguments": {"answer": "6"}}]},
]
FORKS = ("smolagents rewrites its history: an earlier tool call is re-sent as assistant text 'Calling tools:\\n"
         "[{...}]' (a Python repr) with its result as a user 'Observation:' message, so every turn after the first "
         "forks its session (each chain trains one turn)")


@pytest.mark.parametrize("stream", [False, True])
def test_smolagents_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path, stream: bool) -> None:
    skip_unless("smolagents")
    result = run_harness(tmp_path, tiny_path, "smolagents", SCRIPT, f"agent.env.SMOLAGENTS_STREAM={int(stream)}")
    assert set(apis(result)) == {("chat", stream)}
    trained = check_run(result, linear=False)
    # Forks are not errors: every chain of a forked session is exported and each model call trained once.
    assert result.metrics["rollout/fork_count"] > 0, FORKS
    assert {r["branch"] for r in trained} >= {0, 1}
