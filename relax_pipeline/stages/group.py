"""Group: one prompt's sessions as they move through Prepare → Runtime → Reward → Transfer.

A group is the unit of scheduling and of credit: its `n_samples_per_prompt` sessions start together,
are scored together, and are dropped together when one of them fails. Its *runtime groups*
(`runtime_groups`) are the sessions that share a lease and its first-request barrier: the whole group under a
group reward model, one session each under an ordinary reward. Stages fill its fields in order;
the runtime strategy decides when each stage runs. `drop_group` is the one rule for dropping a group,
whoever drops it (a failed agent, a bad reward, a surplus or stale group, an internal error, the run's stop).

Every session ends in exactly one of `OUTCOMES` (`session_outcome`; the dump row's `outcome`, the step's
`rollout/outcome/<name>` counts). Only `completed` and `truncated` sessions yield samples; every other outcome
is a dump row without tokens, so a failure, an infrastructure failure included, never becomes a sample with
reward 0. The session's `status` stays the coarser lifecycle value (`failed`, `dropped`, ...).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from relax_pipeline.agent.session_io import AgentOutput
from relax_pipeline.credit.records import CreditContext
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.turn.leases import AgentRun
from relax_pipeline.turn.sessions import ForestStore, Session, Status

log = logging.getLogger(__name__)

COMPLETED, TRUNCATED, FILTERED = "completed", "truncated", "filtered"
AGENT_ERROR, TIMEOUT, INFRA_ERROR = "agent_error", "timeout", "infra_error"
REWARD_ERROR, SIBLING_FAILED, ABORTED, INTERRUPTED = "reward_error", "sibling_failed", "aborted", "interrupted"
OUTCOMES = (COMPLETED, TRUNCATED, AGENT_ERROR, TIMEOUT, INFRA_ERROR, REWARD_ERROR, SIBLING_FAILED, FILTERED,
            ABORTED, INTERRUPTED)
"""How a session ended, one each. completed: its contexts were scored; truncated: its last turn was cut by the
pipeline's budget (`rollout.max_response_len` or the context limit), whether the agent then exited 0 or failed;
agent_error: the agent exited non-zero, died by a signal, wrote no or a bad output, or its exports did not
match; timeout: `agent.timeout` ran out; infra_error: the agent could not be started or reached, its node was
lost, the pipeline failed internally, or a turn of it failed (HTTP 500); reward_error: its reward could not be
read, or the credit's user function failed; sibling_failed: another session of its group failed (the group is
dropped whole); filtered: the credit filtered its group; aborted: its group was dropped unscored (surplus at the
step's end, stale weights, the run's end); interrupted: the run's stop (SIGINT/SIGTERM) ended it."""


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
    """Sessions whose agent failed after the pipeline's budget cut its last turn: session id → the failure
    (kept in the dump row's `error`)."""
    outcomes: dict[str, str] = field(default_factory=dict)
    """The outcome of the session whose failure dropped the group (session id → one of `OUTCOMES`)."""
    drop_outcome: str | None = None
    """The outcome of the dropped group's other sessions (`sibling_failed`, `aborted`, `interrupted`, ...)."""
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


@dataclass(eq=False)
class RuntimeGroup:
    """The sessions that share one group lease (its first-request barrier, hold and preemption); connects a `Group`
    to `turn.leases.GroupLease` (it is the lease's `Members`). The whole prompt group when the credit needs it
    whole (`credit=group_rm`), else one session: an ordinary reward runs singleton runtime groups, so no session
    waits for its siblings' first requests. Credit still takes the whole prompt group (GRPO's group mean)."""

    id: str
    sessions: list[Session]
    processes: dict[str, AgentRun]
    """The prompt group's agents by session id (the same dict: a session's agent appears once started)."""


def runtime_groups(group: Group, whole: bool) -> list[RuntimeGroup]:
    """`group` as runtime groups: itself when `whole`, else one per session (ids `<group id>/<index>`)."""
    if whole:
        return [RuntimeGroup(group.id, group.sessions, group.processes)]
    return [RuntimeGroup(f"{group.id}/{s.index}", [s], group.processes) for s in group.sessions]


def drop_group(store: ForestStore, group: Group, reason: str, failed: Session | None = None,
               outcome: str = ABORTED) -> str:
    """Drop `group` (the first reason wins) and end its live sessions; returns the group's reason.

    `failed`, when given and still live, ends `failed` with `reason` (the group's reason names it) and with
    `outcome`, its siblings `sibling_failed`; without `failed` every live session ends with `outcome`. Every
    other live session ends `dropped` with the group's reason. Requests held at the group's barrier or
    lease are released (they answer 404). The agents are not terminated here: that is the async caller's
    job (`Runtime`, `Pipeline.cancel_group`); the group's slot is freed when its task ends. A drop by the
    run's stop (`interrupted`) is logged at debug level: the step loop logs one line for all of them.
    """
    if outcome not in OUTCOMES:
        raise ValueError(f"drop_group outcome={outcome!r}; choose one of {list(OUTCOMES)}")
    if group.dropped is None:
        group.dropped = _group_reason(store, reason, failed)
        group.drop_outcome = outcome if failed is None else SIBLING_FAILED
        if failed is not None:
            group.outcomes[failed.id] = outcome
        level = logging.DEBUG if outcome == INTERRUPTED else logging.WARNING
        log.log(level, "group %s dropped: %s", group.id, reason if failed is None else f"session {failed.id}: {reason}")
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


def session_outcome(group: Group, session: Session) -> str:
    """The one outcome of an ended session (`OUTCOMES`), from its status and how its group ended."""
    if session.status.value in (COMPLETED, TRUNCATED, FILTERED):
        return session.status.value
    return group.outcomes.get(session.id) or group.drop_outcome or ABORTED
