"""Reward stage: per exported context, the reward and the group's base credit.

Runs outside the resident capacity. It turns each session's exports into `Context` records holding the
token-exact sample and the reward the agent exported (`reward_object`), then awaits the configured
credit (`credit.base.Credit.score`), which fills the primary reward and the advantage and may filter the
group. A reward that cannot be read fails the session, and so drops the group, like any other session
failure. What it does not do: read or write dump rows (Transfer) or give prompts back (Pipeline).
"""

from __future__ import annotations

import logging

from relax_pipeline.credit.base import Credit, RewardError, filter_group
from relax_pipeline.forest.export import Exported
from relax_pipeline.forest.sample import build_sample
from relax_pipeline.forest.sessions import ForestStore, Session, Status
from relax_pipeline.stages.group import Context, Group

log = logging.getLogger(__name__)


class Reward:
    """Scores exported contexts and assigns their credit by the configured `credit=` option."""

    def __init__(self, store: ForestStore, credit: Credit) -> None:
        self.store = store
        self.credit = credit

    async def run(self, group: Group, exports: dict[str, list[Exported]]) -> None:
        if group.dropped:
            return
        group.contexts = [self._context(group, s, e) for s in group.sessions for e in exports.get(s.id, [])]
        try:
            await self.credit.score(group)
        except RewardError as error:
            group.contexts = []
            self._fail(group, error.session_id, str(error))
            return
        if not await self.credit.keep(group):
            filter_group(group, "credit.filter_path rejected the group")

    @staticmethod
    def _context(group: Group, session: Session, exported: Exported) -> Context:
        raw = exported.record.reward if exported.record is not None else group.outputs[session.id].reward
        return Context(session, exported, build_sample(session.forest, exported.node), None, raw)

    def _fail(self, group: Group, session_id: str | None, reason: str) -> None:
        group.dropped = f"session {session_id} failed: {reason}"
        log.warning("group %s dropped: %s", group.id, group.dropped)
        for session in group.sessions:
            status = Status.FAILED if session.id == session_id else Status.DROPPED
            self.store.set_status(session, status, reason if status is Status.FAILED else group.dropped)
