"""Claude Code (examples/harnesses/claude_code.py, `agent=claude_code`) unchanged through the pipeline:
streamed Anthropic Messages with Claude Code's own tools, two Bash calls and an answer."""

from __future__ import annotations

from pathlib import Path

from harness_run import apis, check_run, run_harness, skip_unless

SCRIPT = [
    {"tool_calls": [{"name": "Bash", "arguments": {"command": "echo 11 - 5 | bc", "description": "Compute"}}]},
    {"reasoning": "bc said 6; check it once more.",
     "tool_calls": [{"name": "Bash", "arguments": {"command": "expr 11 - 5", "description": "Check"}}]},
    {"content": "The answer is 6."},
]


def test_claude_code_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path) -> None:
    skip_unless("claude_agent_sdk")
    result = run_harness(tmp_path, tiny_path, "claude_code", SCRIPT)
    # Claude Code 2.1.332 sends its '# Environment' notes as a role 'system' message inside `messages`.
    assert set(apis(result)) == {("messages", True)}
    for row in check_run(result):
        assert row["turn_count"] == 3
