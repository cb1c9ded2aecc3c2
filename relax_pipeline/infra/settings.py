"""The `ray` node as one record (`RaySettings`): the Ray cluster a run joins or starts (`infra/ray_runtime.py`).

The agent executors (`agent.executor=ray`), the SGLang placement (`engine.placement=ray`) and the trainer's ranks
(`trainer.rank_placement=ray`) take it as a mapping (`dataclasses.asdict`), the form `ray_runtime.connect` reads;
nothing here connects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RaySettings:
    """The Ray cluster of `agent.executor=ray` and `engine.placement=ray` (`infra/ray_runtime.py`): connected once,
    on first use, and left at the end of the run."""

    address: str | None = None
    """null: start a local Ray instance for this run (stopped at the end); `auto` (a cluster started with `ray
    start` on this machine) or `ray://HOST:10001` / `HOST:6379`: join that cluster."""
    num_cpus: int | None = None
    """address=null: logical CPUs of the local instance (null: the machine's cores)."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray runtime_env of the run's workers ({working_dir: ..., pip: [...], env_vars: {...}}): how nodes get the
    package and the agent's code when they do not share this machine's install."""
    node_tmpdir: str | None = None
    """agent.executor=ray: the folder on each node under which a session's files live (input, output, agent.log;
    removed after it); it must exist on every node. null: each node keeps them in memory, under /dev/shm when it is
    memory-backed (tmpfs) with 1 GiB free, else under its temp folder ($TMPDIR, else /tmp); run.log's start line
    says which. Set a disk folder for agents that log gigabytes."""
