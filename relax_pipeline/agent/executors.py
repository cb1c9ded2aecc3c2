"""Where a session's agent runs: the `AgentRun` protocol the stages drive, and the factory that picks it.

`agent.executor` chooses: `local` runs `AgentProcess` (a process group on this machine, `agent/launcher.py`),
`http` runs `HttpAgent` (the session sent to an agent server, `agent/http_executor.py`), `ray` runs `RayAgent`
(the session run on a node of a Ray cluster, `agent/ray_executor.py`; Ray is imported on first use). All count
`agent.timeout` as active time on `timer`, which the group lease pauses and resumes, and all raise
`AgentFailure` (exit code, reason, log tail) from `wait`. Not here: how any of them works.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from relax_pipeline.agent.http_executor import HttpAgent
from relax_pipeline.agent.launcher import ActiveTimer, AgentExit, AgentProcess, AgentSpec
from relax_pipeline.agent.ray_executor import RayAgent

EXECUTORS = {"local": AgentProcess, "http": HttpAgent, "ray": RayAgent}
"""`agent.executor` value → the class that runs one session."""


class AgentRun(Protocol):
    """One session's agent, wherever it runs; connects `stages` (start, wait, terminate) and the group lease
    (`timer`) to an executor."""

    timer: ActiveTimer
    """The active-time budget (`agent.timeout`); paused while the group lease is not held."""

    @property
    def pid(self) -> int | None:
        """The local process (group) id; None before start and for agents that run elsewhere."""
        ...

    @property
    def returncode(self) -> int | None:
        """The agent's exit code once known, None while it runs."""
        ...

    async def start(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Launch the agent with the session's RELAX_* variables; its log goes to `io_dir/agent.log`."""
        ...

    async def wait(self) -> AgentExit:
        """Wait under the active timer; `AgentFailure` unless the agent exits 0."""
        ...

    async def terminate(self) -> None:
        """End the agent and everything it started; idempotent."""
        ...

    def kill(self) -> None:
        """End it at once without waiting (the run's last resort before exiting)."""
        ...

    def tail(self) -> str:
        """The end of the agent's log."""
        ...


def new_agent(spec: AgentSpec) -> AgentRun:
    """The executor `spec.executor` names, for one session."""
    if spec.executor not in EXECUTORS:
        raise ValueError(f"agent.executor={spec.executor!r} is not an executor; choose one of {list(EXECUTORS)}")
    return EXECUTORS[spec.executor](spec)
