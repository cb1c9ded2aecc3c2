"""Reward stage: per exported context, the reward and the group's base credit.

Runs outside the resident capacity. It turns each session's exports into `Context` records holding the
token-exact sample, the primary reward and the advantage. A reward that cannot be read fails the
session, and so drops the group, like any other session failure.
"""

from __future__ import annotations

import logging

from relax_pipeline.credit.reward import RewardCredit, RewardError
from relax_pipeline.forest.export import Exported
from relax_pipeline.forest.sample import build_sample
from relax_pipeline.forest.sessions import ForestStore, Status
from relax_pipeline.stages.group import Context, Group

log = logging.getLogger(__name__)


class Reward:
    """Scores exported contexts and assigns group-normalized credit."""

    def __init__(self, store: ForestStore, credit: RewardCredit) -> None:
        self.store = store
        self.credit = credit

    def run(self, group: Group, exports: dict[str, list[Exported]]) -> None:
        if group.dropped:
            return
        contexts: list[Context] = []
        for session in group.sessions:
            for exported in exports.get(session.id, []):
                try:
                    contexts.append(self._context(group, session, exported))
                except RewardError as error:
                    self._fail(group, session.id, str(error))
                    return
        for context, advantage in zip(contexts, self.credit.advantages([c.reward for c in contexts]), strict=True):
            context.advantage = advantage
        group.contexts = contexts

    def _context(self, group: Group, session, exported: Exported) -> Context:  # noqa: ANN001
        output = group.outputs[session.id]
        raw = exported.record.reward if exported.record is not None else output.reward
        sample = build_sample(session.forest, exported.node)
        return Context(session, exported, sample, self.credit.primary(raw), raw)

    def _fail(self, group: Group, session_id: str, reason: str) -> None:
        group.dropped = f"session {session_id} failed: {reason}"
        log.warning("group %s dropped: %s", group.id, group.dropped)
        for session in group.sessions:
            status = Status.FAILED if session.id == session_id else Status.DROPPED
            self.store.set_status(session, status, reason if status is Status.FAILED else group.dropped)
