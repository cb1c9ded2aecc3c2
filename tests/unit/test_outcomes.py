"""Session outcomes without a run: `drop_group` records them, `session_outcome` reads them, `outcome_counts` counts
sessions (not rows), and `AgentFailure` names its kind. The faults that produce each outcome in a whole run are in
tests/e2e/test_faults.py and tests/e2e/test_terminal_interrupt.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_pipeline.agent.launcher import AgentFailure
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.stages.group import OUTCOMES, Group, drop_group, session_outcome
from relax_pipeline.tracking.metrics import outcome_counts
from relax_pipeline.turn.sessions import ForestStore, Status


def _group(store: ForestStore, n: int = 3) -> Group:
    group = Group("g0-0-abc", Prompt(0, "What is 1 + 1?"), 0, "train", Path("/nonexistent"))
    group.sessions = [store.open(group.id, i, 0, "train", {}) for i in range(n)]
    return group


def test_a_failed_session_names_its_outcome_and_its_siblings_end_sibling_failed() -> None:
    store = ForestStore()
    group = _group(store)
    failed = group.sessions[1]
    drop_group(store, group, "agent timed out after 2 s of active time", failed, "timeout")
    drop_group(store, group, "interrupted by SIGINT", outcome="interrupted")  # the first drop wins
    assert [session_outcome(group, s) for s in group.sessions] == ["sibling_failed", "timeout", "sibling_failed"]
    assert [s.status for s in group.sessions] == [Status.DROPPED, Status.FAILED, Status.DROPPED]


def test_a_drop_without_a_failed_session_gives_every_session_its_outcome() -> None:
    store = ForestStore()
    group = _group(store)
    drop_group(store, group, "interrupted by SIGINT", outcome="interrupted")
    assert {session_outcome(group, s) for s in group.sessions} == {"interrupted"}
    with pytest.raises(ValueError, match="outcome='gone'; choose one of"):
        drop_group(store, _group(store), "why", outcome="gone")


def test_outcome_counts_count_sessions_not_rows() -> None:
    rows = [{"group_id": "g", "index": 0, "status": "completed", "outcome": "completed"},
            {"group_id": "g", "index": 0, "status": "completed", "outcome": "completed"},  # a second context
            {"group_id": "g", "index": 1, "status": "failed", "outcome": "timeout"}]
    assert outcome_counts(rows) == {"rollout/outcome/completed": 1.0, "rollout/outcome/timeout": 1.0}
    assert set(OUTCOMES) >= {"completed", "truncated", "agent_error", "timeout", "infra_error", "interrupted"}


@pytest.mark.parametrize(("reason", "kind"), [
    ("exited with code 3", "agent_error"), ("killed by signal SIGKILL", "agent_error"),
    ("timed out after 2 s of active time", "timeout"), ("could not start (No such file)", "infra_error"),
    ("could not reach the agent server at http://x (ConnectError: refused)", "infra_error"),
    ("lost: node n1 was lost while the agent ran (ActorDiedError)", "infra_error"),
])
def test_an_agent_failure_knows_its_kind(reason: str, kind: str) -> None:
    assert AgentFailure(reason, None, "").kind == kind
    assert AgentFailure(reason, None, "", kind="timeout").kind == "timeout"
