"""`credit=custom_rm` and `credit=group_rm`: rewards from a user function where the agent exported none.

`credit.rm_path` names `module.function` (sync or async). `custom_rm` calls `f(sample) -> float | dict | None`
once per context whose agent exported no reward, concurrently within a group; `group_rm` calls
`f(samples) -> list[float | dict | None]` once per complete group with every context's sample in order
(session order, then export order) and uses the i-th value for the i-th context. A sample is the dict of
`CreditContext.sample_dict`: `name`, `messages`, `metadata`, `prompt` (the session's input payload) and
`reward` (what the agent exported, None when nothing). The agent's own reward always wins: RM values
only fill contexts without one. An object's `credit.reward_key` field is the primary value and its other
numeric fields become `rollout/<field>/*` metrics. Credit then follows `credit.estimator` as for
`credit=reward`; `group_rm` with `credit.advantage_path` hands the scored group to that advantage function
instead (RM scores, then the hook: `credit/custom_advantage.py`). That pairing credits sessions that export
several contexts (a main agent and its sub-agents): the RM may review only some contexts and leave the
others null, and the advantage function gives every context its credit.

A value that is not a number, an object or null fails its session (like a bad exported reward); a group
RM result that is not a list of the group's length drops the group with an error naming `credit.rm_path`.
Exceptions raised by the user function drop the group with the error (`stages/reward.py`). No retries.
"""

from __future__ import annotations

import asyncio
from typing import Any

from relax_pipeline.credit.base import call_user
from relax_pipeline.credit.custom_advantage import hook_advantages
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.credit.reward import RewardCredit
from relax_pipeline.credit.settings import CreditSettings


class CustomRMCredit(RewardCredit):
    """`credit=custom_rm`: one call of the user reward function per unrewarded context."""

    option = "custom_rm"
    uses = ("rm_path",)

    async def fill_rewards(self, group: CreditGroup) -> None:
        missing = [c for c in group.contexts if c.reward_object is None]
        values = await asyncio.gather(*(call_user(self.user_function, c.sample_dict()) for c in missing))
        for context, value in zip(missing, values, strict=True):
            context.reward_object = value
        await super().fill_rewards(group)


class GroupRMCredit(RewardCredit):
    """`credit=group_rm`: one call of the user reward function per complete group; with `credit.advantage_path`
    the advantage function then gives the base credit (`credit/custom_advantage.py`), as the seed's group RM
    plus custom advantage."""

    option = "group_rm"
    uses = ("rm_path",)
    optional = ("advantage_path",)
    whole_groups = True

    def __init__(self, settings: CreditSettings) -> None:
        super().__init__(settings)
        self.needs_reward = self.advantage_hook is None
        """With an advantage function the RM rewards only what it reviews (metrics, filters): a context it leaves
        null (a sub-agent's) still gets its credit from the function."""

    @classmethod
    def credits_several(cls, settings: CreditSettings) -> bool:
        """With an advantage function, several contexts per session get their credit from it."""
        return settings.advantage_path is not None

    async def score(self, group: CreditGroup) -> None:
        if self.advantage_hook is None:
            await super().score(group)
            return
        await self.fill_rewards(group)
        await hook_advantages(self, group, self.advantage_hook, self.advantage_path)

    async def fill_rewards(self, group: CreditGroup) -> None:
        if any(c.reward_object is None for c in group.contexts):
            values = await call_user(self.user_function, [c.sample_dict() for c in group.contexts])
            self._fill(group.contexts, self._checked(values, len(group.contexts)))
        await super().fill_rewards(group)

    def _checked(self, values: Any, expected: int) -> list[Any]:
        if not isinstance(values, list | tuple):
            raise ValueError(f"credit.rm_path={self.rm_path!r} must return a list of rewards (one per sample), "
                             f"got {type(values).__name__}")
        if len(values) != expected:
            raise ValueError(f"credit.rm_path={self.rm_path!r} returned {len(values)} rewards for {expected} "
                             "samples; return one reward per sample, in the order given")
        return list(values)

    @staticmethod
    def _fill(contexts: list[CreditContext], values: list[Any]) -> None:
        for context, value in zip(contexts, values, strict=True):
            if context.reward_object is None:
                context.reward_object = value
