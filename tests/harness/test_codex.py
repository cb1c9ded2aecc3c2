"""Codex (examples/harnesses/codex_exec.py, `agent=codex`) unchanged through the pipeline: `codex exec` on
streamed Responses with Codex's own tools, two `exec_command` calls and an answer."""

from __future__ import annotations

from pathlib import Path

from harness_run import apis, check_run, run_harness, skip_unless

SCRIPT = [
    {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": "echo 11 - 5 | bc"}}]},
    {"reasoning": "bc said 6; check it once more.",
     "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "expr 11 - 5"}}]},
    {"content": "The answer is 6."},
]


def test_codex_exec_runs_through_the_pipeline(tmp_path: Path, tiny_path: Path) -> None:
    skip_unless("codex_cli_bin")
    result = run_harness(tmp_path, tiny_path, "codex", SCRIPT)
    assert set(apis(result)) == {("responses", True)}
    for row in check_run(result):
        assert row["turn_count"] == 3
