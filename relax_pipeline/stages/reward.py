"""Reward stage: per exported context, the reward and the group's base credit.

Runs outside the resident capacity. It turns each session's exports into `CreditContext` records holding the
token-exact sample, the final export metadata and the reward the agent exported (`reward_object`), then awaits
the configured credit (`credit.base.Credit.score`) on a `CreditGroup`, which fills the primary reward and the
advantage and may filter the group; the scored contexts go back onto the `Group`. A reward that cannot be read
fails the session, and so drops the group, like any other session failure (outcome `reward_error`); so does a
train session that exports several contexts when the run lacks what that needs (`credit=custom_advantage` and
dynamic batching, `config.multi_context_missing`): the failure names the keys. A reward model, advantage hook
or group filter that raises or returns the wrong shape drops the group with the error (naming the `credit.*`
key; outcome `reward_error`) instead of stopping the run: the pipeline starts a replacement group like for any
other drop. Filtered groups are logged here with the reason. What it does not do: read or write dump rows
(Transfer) or give prompts back (Pipeline)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from relax_pipeline.credit.base import Credit, RewardError, filter_group
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.forest.export import Exported
from relax_pipeline.forest.sample import build_sample
from relax_pipeline.stages.group import AGENT_ERROR, REWARD_ERROR, Group, drop_group
from relax_pipeline.turn.sessions import ForestStore, Session

log = logging.getLogger(__name__)


class Reward:
    """Scores exported contexts and assigns their credit by the configured `credit=` option."""

    def __init__(self, store: ForestStore, credit: Credit, multi_context_missing: Sequence[str] | None = None) -> None:
        self.store = store
        self.credit = credit
        default = () if credit.several_contexts else ("credit=custom_advantage",)
        self.multi_context_missing = tuple(default if multi_context_missing is None else multi_context_missing)
        """What the run lacks for train sessions that export several contexts; empty when they are fine."""

    async def run(self, group: Group, exports: dict[str, list[Exported]]) -> None:
        if group.dropped or self._refuse_several(group, exports):
            return
        scored = CreditGroup(group.id, group.mode, len(group.sessions),
                             [self._context(group, i, s, e) for i, s in enumerate(group.sessions)
                              for e in exports.get(s.id, [])])
        _mark(group, "scoring")  # the `reward` and `credit` spans of the sessions' traces (stages/traces.py)
        try:
            await self.credit.score(scored)
            _mark(group, "scored")
            if not scored.filtered and not await self.credit.keep(scored):
                filter_group(scored, "credit.filter_path rejected the group")
        except RewardError as error:
            self._fail(group, error.session_id, str(error), REWARD_ERROR)
            return
        except Exception as error:  # noqa: BLE001 - user code (reward model, advantage hook, filter): drop, go on
            reason = f"{self._user_keys()}: {type(error).__name__}: {error}"
            log.warning("group %s dropped: the credit failed: %s", group.id, reason)
            drop_group(self.store, group, reason, outcome=REWARD_ERROR)
            return
        group.contexts, group.filtered = scored.contexts, scored.filtered
        _mark(group, "credited")
        if group.filtered:
            log.info("group %s filtered: %s", group.id, group.filtered)

    def _refuse_several(self, group: Group, exports: dict[str, list[Exported]]) -> bool:
        """Fail the first train session with several contexts when the run lacks what they need."""
        if group.mode != "train" or not self.multi_context_missing:
            return False
        for session in group.sessions:
            names = list(dict.fromkeys(e.name for e in exports.get(session.id, [])))  # chains share a name
            if len(names) > 1:
                missing = " and ".join(self.multi_context_missing)
                reason = (f"the session exported {len(names)} contexts {names}; several contexts per session need "
                          f"{missing} (declare such agents with agent.multi_context=true)")
                self._fail(group, session.id, reason, AGENT_ERROR)
                return True
        return False

    @staticmethod
    def _context(group: Group, slot: int, session: Session, exported: Exported) -> CreditContext:
        """The credit record of one export: its sample, final metadata and exported reward."""
        record, output = exported.record, group.outputs.get(session.id)
        if record is not None:
            metadata, raw = record.metadata, record.reward
        else:
            metadata, raw = (output.metadata, output.reward) if output is not None else ({}, None)
        sample = build_sample(session.forest, exported.node, exported.shared)
        return CreditContext(slot, session.id, exported.name, sample, metadata, session.prompt, raw,
                             branch=exported.branch, truncated_failure=session.id in group.truncated)

    def _user_keys(self) -> str:
        """The configured user functions (`credit.rm_path=...`), so a failure names the key to look at."""
        keys = [f"credit.{key}={value!r}" for key in ("rm_path", "advantage_path", "filter_path")
                if (value := getattr(self.credit, key, None))]
        return ", ".join(keys) or "credit"

    def _fail(self, group: Group, session_id: str | None, reason: str, outcome: str) -> None:
        """Fail the session (`outcome`; without it the whole group ends with `outcome`) and drop the group."""
        failed = next((s for s in group.sessions if s.id == session_id), None)
        drop_group(self.store, group, reason, failed, outcome)


def _mark(group: Group, event: str) -> None:
    """Stamp `event` on every session of `group` (its dump row's `timing` and its trace)."""
    for session in group.sessions:
        session.mark(event)
