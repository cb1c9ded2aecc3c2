"""Group: one prompt's sessions as they move through Prepare → Runtime → Reward → Transfer.

A group is the unit of scheduling and of credit: its `n_samples_per_prompt` sessions start together,
are scored together, and are dropped together when one of them fails. Stages fill its fields in order;
the runtime strategy decides when each stage runs. `drop_group` is the one rule for dropping a group,
whoever drops it (a failed agent, a bad reward, a surplus or stale group, an internal error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from relax_pipeline.agent.session_io import AgentOutput
from relax_pipeline.credit.records import CreditContext
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.turn.leases import AgentRun
from relax_pipeline.turn.service import ForestStore, Session, Status

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt and its sessions; owned by the pipeline, filled stage by stage."""

    id: str
    prompt: Prompt
    rollout_id: int
    mode: str
    io_dir: Path
    sessions: list[Session] = field(default_factory=list)
    processes: dict[str, AgentRun] = field(default_factory=dict)
    """Each session's agent (`agent.executor`: a local process group or a session on an agent server)."""
    outputs: dict[str, AgentOutput] = field(default_factory=dict)
    truncated: dict[str, str] = field(default_factory=dict)
    """Sessions whose agent failed after our length limit cut its last turn: session id → the failure."""
    contexts: list[CreditContext] = field(default_factory=list)
    """The scored contexts (session order, then export order), filled by the Reward stage."""
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


def drop_group(store: ForestStore, group: Group, reason: str, failed: Session | None = None) -> str:
    """Drop `group` (the first reason wins) and end its live sessions; returns the group's reason.

    `failed`, when given and still live, ends `failed` with `reason` (the group's reason names it); every
    other live session ends `dropped` with the group's reason. Requests held at the group's barrier or
    lease are released (they answer 404). The agents are not terminated here: that is the async caller's
    job (`Runtime`, `Pipeline.cancel_group`); the group's slot is freed when its task ends.
    """
    if group.dropped is None:
        group.dropped = _group_reason(store, reason, failed)
        log.warning("group %s dropped: %s", group.id, reason if failed is None else f"session {failed.id}: {reason}")
    for session in group.sessions:
        store.set_status(session, Status.DROPPED, group.dropped)
    for lease in {id(s.lease): s.lease for s in group.sessions if s.lease is not None}.values():
        lease.notify()
    return group.dropped


def _group_reason(store: ForestStore, reason: str, failed: Session | None) -> str:
    if failed is None:
        return reason
    if failed.status.terminal:
        return f"session {failed.id} {failed.status.value}: {failed.error}"
    store.set_status(failed, Status.FAILED, reason)
    return f"session {failed.id} failed: {reason.splitlines()[0] if reason else reason}"
