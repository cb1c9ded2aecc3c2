"""Claude Code (examples/harnesses/claude_code.py, `agent=claude_code`) unchanged through the pipeline:
streamed Anthropic Messages with Claude Code's own tools, two Bash calls and an answer."""

from __future__ import annotations

from pathlib import Path

from harness_run import apis, check_run, run_harness, skip_unless, xfail_on_gateway_error

SCRIPT = [
    {"tool_calls": [{"name": "Bash", "arguments": {"command": "echo 11 - 5 | bc", "description": "Compute"}}]},
    {"reasoning": "bc said 6; check it once more.",
     "tool_calls": [{"name": "Bash", "arguments": {"command": "expr 11 - 5", "description": "Check"}}]},
    {"content": "The answer is 6."},
]
SYSTEM_ROLE = ("Claude Code 2.1.332 sends a role 'system' message inside `messages` (messages[1], its '# Environment' "
               "section, beta mid-conversation-tool-changes-2026-07-01); /v1/messages answers 400 "
               "\"messages[1].role: role must be 'user' or 'assistant', got 'system'\"")


def test_claude_code_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path) -> None:
    skip_unless("claude_agent_sdk")
    result = run_harness(tmp_path, tiny_path, "claude_code", SCRIPT)
    xfail_on_gateway_error(result, "role must be 'user' or 'assistant', got 'system'", SYSTEM_ROLE)
    assert set(apis(result)) == {("messages", True)}
    for row in check_run(result):
        assert row["turn_count"] == 3
