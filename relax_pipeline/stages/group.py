"""Group: one prompt's sessions as they move through Prepare → Runtime → Reward → Transfer.

A group is the unit of scheduling and of credit: its `n_samples_per_prompt` sessions start together,
are scored together, and are dropped together when one of them fails. Stages fill its fields in order;
the runtime strategy decides when each stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_pipeline.agent.launcher import AgentProcess
from relax_pipeline.agent.session_io import AgentOutput
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.forest.export import Exported
from relax_pipeline.forest.sample import Sample
from relax_pipeline.turn.sessions import Session


@dataclass
class Context:
    """One exported context of one session with its credit; connects Reward to Transfer."""

    session: Session
    exported: Exported
    sample: Sample
    reward: float | None = None
    reward_object: Any = None
    advantage: float | None = None


@dataclass
class Group:
    """One prompt and its sessions; owned by the pipeline, filled stage by stage."""

    id: str
    prompt: Prompt
    rollout_id: int
    mode: str
    io_dir: Path
    sessions: list[Session] = field(default_factory=list)
    processes: dict[str, AgentProcess] = field(default_factory=dict)
    outputs: dict[str, AgentOutput] = field(default_factory=dict)
    contexts: list[Context] = field(default_factory=list)
    dropped: str | None = None
    """Why the group was dropped (the first failure), None while it is healthy."""
    filtered: str | None = None
    """Why the credit filtered the group (for example the advantage hook returned None)."""

    @property
    def excluded(self) -> str | None:
        """Why the group yields no training samples (dropped or filtered), None when it does."""
        return self.dropped or self.filtered

    def session_dir(self, session: Session) -> Path:
        return self.io_dir / f"{self.id}-{session.index}"
