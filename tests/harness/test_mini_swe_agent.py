"""mini-swe-agent (examples/harnesses/mini_swe_agent.py, `agent=mini_swe_agent`) unchanged through the
pipeline: tool-call mode on Chat Completions, two bash commands and the submit command."""

from __future__ import annotations

from pathlib import Path

from harness_run import apis, check_run, run_harness, skip_unless

SCRIPT = [
    {"content": "First compute it.", "tool_calls": [{"name": "bash", "arguments": {"command": "echo 11 - 5 | bc"}}]},
    {"reasoning": "bc said 6.", "content": "Check once more.",
     "tool_calls": [{"name": "bash", "arguments": {"command": "expr 11 - 5"}}]},
    {"content": "Done: 6.", "tool_calls": [{"name": "bash",
                                           "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}]},
]


def test_mini_swe_agent_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path) -> None:
    skip_unless("minisweagent")
    result = run_harness(tmp_path, tiny_path, "mini_swe_agent", SCRIPT)
    assert set(apis(result)) == {("chat", False)}
    for row in check_run(result):
        assert row["turn_count"] == 3
        assert row["messages"][-1]["tool_calls"][0]["function"]["name"] == "bash"
