"""What every harness runner shares: the task's prompt from `RELAX_INPUT_JSON` and a local shell tool.

The runners are ordinary user scripts; this module only spares each of them the same few lines. It knows
nothing about any harness and never talks to the model.
"""

from __future__ import annotations

import json
import os
import subprocess


def task_prompt() -> str:
    """The text of the task's last user message (a string input arrives as one user message)."""
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    users = [m for m in task.get("messages", []) if m.get("role") == "user"]
    content = users[-1]["content"] if users else ""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")
    return str(content)


def shell(command: str, timeout: float = 30.0) -> str:
    """Run `command` with bash in the current folder; its stdout and stderr together, or the error."""
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"error: timed out after {timeout:.0f} s"
    output = done.stdout + done.stderr
    return output if done.returncode == 0 else f"{output}\n(exit code {done.returncode})"


def flag(name: str) -> bool:
    """An on/off environment setting: 1, true, yes or on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
