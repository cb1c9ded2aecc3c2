"""`credit=reward`: credit from exported rewards; the base class of every `credit=` option.

A context's reward is what the agent exported: a number, or an object whose `credit.reward_key` field
is the primary value (its other numeric fields are kept in `CreditContext.reward_object` for metrics). A train
context left without a reward (`null` or absent, and no reward model) fails its session, naming the `reward` field
and `credit.rm_path`: the estimator needs every reward, and a group without one would silently train nothing
(eval contexts without one are kept, unscored). The base scalar credit of a group comes from `credit.estimator`
(`credit/advantage.py`: GRPO's group-centred reward, optionally std-normalized, RLOO, REINFORCE++) over
all its contexts in order.

Subclasses change one step: where missing rewards come from (credit/reward_model.py) or how the base
credit is computed (credit/custom_advantage.py). Token expansion and whitening are the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from relax_pipeline.credit.advantage import base_advantages
from relax_pipeline.credit.base import RewardError, call_user, load_function
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.credit.user_metrics import UserMetrics

__all__ = ["RewardCredit", "RewardError"]


class RewardCredit:
    """`credit=reward`: read rewards from the agents' outputs; base credit per group by the estimator."""

    option: str = "reward"
    """The `credit=` option this class implements (named in errors)."""
    uses: tuple[str, ...] = ()
    """Which of `rm_path` / `advantage_path` this option needs; the others must stay null unless `optional`."""
    optional: tuple[str, ...] = ()
    """Which of them this option may also take (`credit=group_rm` with an `advantage_path`: RM, then the hook)."""
    several_contexts: bool = False
    """Whether this option gives credit to sessions that export several contexts (custom_advantage, and group_rm
    with an advantage function: `credits_several`)."""
    whole_groups: bool = False
    """Whether the reward needs the whole group (group RM): the runtime then keeps the prompt group as one runtime
    group, behind its first-request barrier. An ordinary per-session reward runs singleton runtime groups."""

    def __init__(self, settings: CreditSettings) -> None:
        self._check_paths({"rm_path": settings.rm_path, "advantage_path": settings.advantage_path})
        self.reward_key = settings.reward_key
        self.rm_path = settings.rm_path
        self.advantage_path = settings.advantage_path
        self.estimator = settings.estimator
        self.normalize_std = settings.normalize_std
        self.log_passrate = settings.log_passrate
        self.truncated_reward = settings.truncated_reward
        """Reward of a context whose agent failed after our length limit cut its last turn (none exported)."""
        self.several_contexts = self.credits_several(settings)
        self.user_function = self._load_user_function()
        self.advantage_hook = self._load_optional("advantage_path")
        """The optional advantage function (`optional`), None when the option has none or it is unset."""
        self.group_filter = load_function(settings.filter_path, "credit.filter_path") if settings.filter_path else None
        self.user_metrics = UserMetrics(settings.metrics_path)
        """`credit.metrics_path`: the user's metrics of each train step's rows (empty without it)."""

    @classmethod
    def credits_several(cls, settings: CreditSettings) -> bool:
        """Whether this option, so configured, gives credit to sessions that export several contexts."""
        return cls.several_contexts

    def _load_user_function(self) -> Callable[..., Any] | None:
        """The function named by the one path key this option uses, None for `credit=reward`."""
        for key in self.uses:
            return load_function(getattr(self, key), f"credit.{key}")
        return None

    def _load_optional(self, key: str) -> Callable[..., Any] | None:
        """The function named by an optional path key (`optional`), None when it is unset."""
        value = getattr(self, key)
        return load_function(value, f"credit.{key}") if key in self.optional and value else None

    def _check_paths(self, paths: dict[str, str | None]) -> None:
        for key, value in paths.items():
            if key in self.uses and not value:
                raise ValueError(f"credit={self.option} needs credit.{key} set to 'module.function'")
            if key not in self.uses + self.optional and value:
                raise ValueError(f"credit.{key}={value!r} is not used by credit={self.option}; unset it or choose "
                                 "credit=custom_rm / group_rm (rm_path, group_rm may add advantage_path) or "
                                 "credit=custom_advantage (advantage_path)")

    async def score(self, group: CreditGroup) -> None:
        """Primary rewards, then the group's base credit by `credit.estimator`."""
        await self.fill_rewards(group)
        self.fill_advantages(group)

    async def keep(self, group: CreditGroup) -> bool:
        """`credit.filter_path` on a scored train group (eval groups are never filtered)."""
        if self.group_filter is None or group.mode != "train" or group.filtered:
            return True
        return bool(await call_user(self.group_filter, [c.sample_dict() for c in group.contexts]))

    needs_reward: bool = True
    """Whether every context must end with a reward (the estimator needs one); the advantage hook does not."""

    async def fill_rewards(self, group: CreditGroup) -> None:
        """Each context's primary reward; a train context left without one fails its session (`needs_reward`;
    eval contexts without one only count as unscored)."""
        for context in group.contexts:
            if context.reward_object is None and context.truncated_failure:
                context.reward_object = self.truncated_reward
            context.reward = self.primary_of(context, context.reward_object)
            if context.reward is None and self.needs_reward and group.mode == "train":
                raise RewardError(self._no_reward(context), context.session_id)

    def _no_reward(self, context: CreditContext) -> str:
        """Why a context has no reward, naming what to set."""
        name = "the implicit context" if context.name is None else f"context {context.name!r}"
        if not self.uses:
            return (f"{name} has no reward: the agent exported none (write \"reward\" to RELAX_OUTPUT_JSON) and "
                    "the run has no reward model (set credit=custom_rm credit.rm_path=module.function)")
        return f"{name} has no reward: credit.rm_path={self.rm_path!r} returned null; return a number or an object"

    def fill_advantages(self, group: CreditGroup) -> None:
        """The estimator over the group's units (`CreditContext.unit`); the chains of one forked session's
        implicit export share their unit's credit."""
        units: dict[tuple[int, str | None], list[CreditContext]] = {}
        for context in group.contexts:
            units.setdefault(context.unit, []).append(context)
        shares = self.advantages([members[0].reward for members in units.values()])
        for members, advantage in zip(units.values(), shares, strict=True):
            for context in members:
                context.advantage = advantage

    def primary_of(self, context: CreditContext, reward: Any) -> float | None:
        """`primary`, with errors that fail the context's session."""
        try:
            return self.primary(reward)
        except RewardError as error:
            raise RewardError(str(error), context.session_id) from None

    def primary(self, reward: Any) -> float | None:
        """The primary scalar of a reward (number, object with reward_key, or null)."""
        if reward is None:
            return None
        if isinstance(reward, bool):
            return float(reward)
        if isinstance(reward, int | float):
            return _finite(float(reward), "reward")
        if isinstance(reward, dict):
            return self._from_object(reward)
        raise RewardError(f"reward must be a number, an object or null, got {type(reward).__name__}")

    def _from_object(self, reward: dict[str, Any]) -> float | None:
        if self.reward_key is None:
            raise RewardError("the reward is an object; set credit.reward_key to its primary field "
                              f"(one of {sorted(reward)})")
        if self.reward_key not in reward:
            raise RewardError(f"reward object has no {self.reward_key!r} (credit.reward_key); it has {sorted(reward)}")
        return self.primary(reward[self.reward_key])

    def advantages(self, rewards: Sequence[float | None]) -> list[float | None]:
        """Base credit of one group by `credit.estimator`; a group with a missing reward gets none."""
        if not rewards or any(r is None for r in rewards):
            return [None] * len(rewards)
        return list(base_advantages([float(r) for r in rewards if r is not None], self.estimator, self.normalize_std))


def _finite(value: float, key: str) -> float:
    if not math.isfinite(value):
        raise RewardError(f"{key} must be finite, got {value}")
    return value
