"""`credit.metrics_path`: a user's own rollout metrics, computed from each train step's dump rows.

The hook is `module.function(rows) -> dict[str, float]`, sync or async, called once per train step with copies
of the step's dump rows (one dict per exported context and per failed or dropped session, as
`debug.save_rollout_data` writes them). Each returned value is logged as `rollout/user/<name>` next to the
run's own metrics. A hook that raises or returns something else is the user's bug, not the run's: the step's
metrics carry `rollout/user/errors` = 1 and run.log says what went wrong, naming `credit.metrics_path`; the
run goes on.

What it does not do: see eval rows (eval steps have their own metrics), change rows, or retry.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from relax_pipeline.credit.base import call_user, load_function

log = logging.getLogger(__name__)
PREFIX = "rollout/user/"


class UserMetrics:
    """The loaded `credit.metrics_path` hook; `None` path: no metrics and no calls."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.hook: Callable[..., Any] | None = load_function(path, "credit.metrics_path") if path else None

    async def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        """The hook's metrics for one step's rows, prefixed; an error becomes `rollout/user/errors` = 1."""
        if self.hook is None:
            return {}
        try:
            values = await call_user(self.hook, copy.deepcopy(list(rows)))
            return {PREFIX + name: value for name, value in self._checked(values).items()}
        except Exception as error:  # noqa: BLE001 - a user's hook must not end the run
            log.warning("credit.metrics_path=%r failed: %s: %s; the step's metrics carry rollout/user/errors=1",
                        self.path, type(error).__name__, error)
            return {PREFIX + "errors": 1.0}

    def _checked(self, values: Any) -> dict[str, float]:
        if not isinstance(values, dict):
            raise TypeError(f"it must return a dict of metric name -> number, got {type(values).__name__}")
        out = {}
        for name, value in values.items():
            if not isinstance(name, str) or not name or isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"metric {name!r}={value!r}: names are non-empty strings and values numbers")
            if not math.isfinite(value):
                raise ValueError(f"metric {name!r}={value!r} is not finite")
            out[name] = float(value)
        return out
