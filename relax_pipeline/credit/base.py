"""The credit interface shared by every `credit=` option, and the helpers its implementations share.

Contract: the Reward stage builds one `CreditContext` per exported context (session order, then export
order; `credit/records.py`) with `reward_object` holding the reward the agent exported (None when absent),
then awaits `credit.score(group)`, which fills `reward` (the primary scalar) and `advantage` (the base
credit) of every context. A credit may filter a whole group (`filter_group`): the group is then handled like a
dropped one (its prompt goes back to the data source) but its sessions end `filtered`, not `dropped`.

Also here: loading a user function from a `module.function` config value (errors name the key), calling
it whether it is sync or async. What this module does not do: read rewards or compute advantages
(credit/reward.py, credit/advantage.py).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from relax_pipeline.credit.records import CreditGroup


class RewardError(ValueError):
    """A reward with no usable primary value; fails its session. The message names the key."""

    def __init__(self, message: str, session_id: str | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id


class Credit(Protocol):
    """What the Reward stage needs from a `credit=` option."""

    log_passrate: bool
    several_contexts: bool
    """Whether it gives credit to sessions that export several contexts."""
    whole_groups: bool
    """Whether its reward needs the whole group before scoring (`credit=group_rm`): the group's sessions then run as
    one runtime group, behind its first-request barrier; otherwise each session is its own runtime group."""
    user_metrics: Callable[[Sequence[dict[str, Any]]], Awaitable[dict[str, float]]]
    """`credit.metrics_path`'s metrics of a train step's rows (an empty dict without the hook)."""

    async def keep(self, group: CreditGroup) -> bool:
        """Whether a scored group stays in the step (`credit.filter_path`)."""

    async def score(self, group: CreditGroup) -> None:
        """Fill `reward` and `advantage` of `group.contexts`; may call `filter_group`."""
        ...


def filter_group(group: CreditGroup, reason: str) -> None:
    """Drop `group` from training as filtered (not failed): its prompt goes back to the data source."""
    group.filtered = reason


def load_function(path: str | None, key: str) -> Callable[..., Any]:
    """Import `module.function` named by config key `key`; errors name the key and the fix."""
    module_name, _, attr = (path or "").rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{key}={path!r} must be 'module.function' (an importable module and a function in it)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{key}={path!r}: cannot import module {module_name!r} ({error}); make it importable "
                         "from the working directory or PYTHONPATH") from error
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"{key}={path!r}: module {module_name!r} has no function {attr!r}")
    return function


async def call_user(function: Callable[..., Any], argument: Any) -> Any:
    """Call a user function: async ones are awaited, sync ones run in a worker thread."""
    if inspect.iscoroutinefunction(function):
        return await function(argument)
    result = await asyncio.to_thread(function, argument)
    return await result if inspect.isawaitable(result) else result
