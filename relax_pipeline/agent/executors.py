"""Where a session's agent runs: the factory that picks the executor for `agent.executor`.

`agent.executor` chooses: `local` runs `AgentProcess` (a process group on this machine, `agent/launcher.py`),
`http` runs `HttpAgent` (the session sent to an agent server, `agent/http_executor.py`), `ray` runs `RayAgent`
(the session run on a node of a Ray cluster, `agent/ray_executor.py`; Ray is imported on first use). All count
`agent.timeout` as active time on `timer`, which the group lease pauses and resumes, and all raise
`AgentFailure` (exit code, reason, log tail) from `wait`: each satisfies the `AgentRun` protocol that its
consumers declare (`turn/leases.py`), structurally. Not here: how any of them works, that protocol.
"""

from __future__ import annotations

from relax_pipeline.agent.http_executor import HttpAgent
from relax_pipeline.agent.launcher import AgentProcess, AgentSpec
from relax_pipeline.agent.ray_executor import RayAgent

EXECUTORS = {"local": AgentProcess, "http": HttpAgent, "ray": RayAgent}
"""`agent.executor` value → the class that runs one session."""


Executor = AgentProcess | HttpAgent | RayAgent
"""What `new_agent` returns: each satisfies `turn.leases.AgentRun` (the protocol its consumers declare) without
importing it."""


def new_agent(spec: AgentSpec) -> Executor:
    """The executor `spec.executor` names, for one session."""
    if spec.executor not in EXECUTORS:
        raise ValueError(f"agent.executor={spec.executor!r} is not an executor; choose one of {list(EXECUTORS)}")
    return EXECUTORS[spec.executor](spec)
