"""`runtime=sync`: each step runs groups under the resident capacity until it has `rollout.batch_size`.

Up to `rollout.over_sampling_batch_size` groups (default `rollout.batch_size`; at most the resident capacity at a
time) start at once, leased: each session generates at once (an ordinary reward: singleton runtime groups), or once
its group's first-request barrier passes (`credit=group_rm`: the whole group is one runtime group). Groups finish
their agents inside the capacity and are scored outside it, one by one as they come in: a group that is dropped (a
session failed) or filtered (its credit or `credit.filter_path` rejected it) is replaced by new groups within the
step, keeping the step's over-sampling margin over the groups still missing (12 of 8 at the start: 6 running while 4
are missing), up to `MAX_STARTS_PER_NEED` starts per needed group, after which the step ends short and says so. Once
the step has its groups, the groups still resident are surplus: their agents are terminated and their sessions
recorded as dropped ("surplus"), and their prompts go back to the data source like every excluded group's, so an
epoch still covers every prompt. Their generated tokens, and those of filtered groups, are logged as
`rollout/wasted_tokens`. When the run is interrupted (`Pipeline.interrupt`) the step collects what is left, starts
nothing new and ends short.

`SyncRuntime` is also the base of `prelaunch` and `partial`, which change only how a step opens and
closes (`_open_step`, `_close_step`), and of `fully_async`, which replaces `rollout`.
"""

from __future__ import annotations

import logging
import time

from relax_pipeline.scheduling.base import Binding
from relax_pipeline.scheduling.pool import GroupPool, Outcome
from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.stages.pipeline import SURPLUS, Pipeline, StepResult

log = logging.getLogger(__name__)
MAX_STARTS_PER_NEED = 4


class SyncRuntime:
    """The baseline strategy. It takes the `runtime` node (`RuntimeSettings`); the capacity keys (`concurrency`,
    `eval_concurrency`, `external_slots`) reach it once resolved, through `bind`."""

    retains_train_sessions = False
    """Train sessions end with their step, so eval never runs beside them (see `runtime.capacity`)."""

    reads_staleness = False
    """Whether this mode reads `runtime.max_staleness` (fully_async); the others refuse it set."""

    def __init__(self, settings: RuntimeSettings) -> None:
        if settings.max_staleness is not None and not self.reads_staleness:
            raise ValueError(f"runtime.max_staleness={settings.max_staleness!r} is not used by {type(self).__name__}; "
                             "unset it or choose the runtime mode that uses it (runtime=fully_async)")
        self.max_aborted_count = settings.max_aborted_count
        self.barrier_warn_s = settings.barrier_warn_s
        self.binding: Binding | None = None
        self.pool: GroupPool | None = None

    def bind(self, binding: Binding) -> None:
        """Take the resident capacity, engine and step count the run resolved (`runtime.base.Binding`)."""
        self.binding = binding

    def _pool(self, pipeline: Pipeline) -> GroupPool:
        if self.pool is None:
            if self.binding is None:
                raise RuntimeError(f"{type(self).__name__}.bind() must be called before rollout()")
            self.pool = GroupPool(pipeline, self.binding.engine, self.binding.capacity, self.max_aborted_count,
                                  self.barrier_warn_s)
        return self.pool

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        started, need = time.time(), pipeline.batch_size
        pipeline.source.new_step()
        pool = self._pool(pipeline)
        result = StepResult(rollout_id)
        accepted, starts = await self._collect(pool, result, rollout_id, need, self._open_step(pool, rollout_id, need))
        if accepted < need and pipeline.stopped:
            log.warning("rollout %d: interrupted with %d of %d groups (%s)", rollout_id, accepted, need,
                        pipeline.stopped)
        elif accepted < need:
            log.warning("rollout %d: only %d of %d groups after %d starts (every other group was dropped or "
                        "filtered); the step goes on short", rollout_id, accepted, need, starts)
        extra = await self._close_step(pool, result, rollout_id, need)
        result.groups.sort(key=lambda g: g.id)
        closed = await pipeline.close_step(result, started)
        closed.metrics.update(extra)
        return closed

    def _wanted(self, need: int) -> int:
        assert self.binding is not None
        return max(need, self.binding.over_sampling or need)

    def _is_last(self, rollout_id: int) -> bool:
        assert self.binding is not None
        return self.binding.num_steps is not None and rollout_id >= self.binding.num_steps - 1

    def _open_step(self, pool: GroupPool, rollout_id: int, need: int) -> int:
        """Launch the step's groups (leased); returns how many groups this step started."""
        count = max(0, self._wanted(need) - pool.pending)
        for _ in range(count):
            pool.launch(rollout_id)
        return count

    async def _collect(self, pool: GroupPool, result: StepResult, rollout_id: int, need: int,
                       starts: int) -> tuple[int, int]:
        """Score finished groups until `need` are accepted, replacing dropped and filtered ones; returns the
        groups accepted and the step's starts, the `starts` it was given plus the replacements."""
        accepted = 0
        while accepted < need and (outcome := await pool.next_done()) is not None:
            accepted += await self._score(pool.pipeline, result, outcome)
            while pool.pending < self._in_flight(need, accepted) and starts < MAX_STARTS_PER_NEED * need:
                pool.launch(rollout_id)
                starts += 1
        return accepted, starts

    def _in_flight(self, need: int, accepted: int) -> int:
        """Groups to keep running while `need - accepted` are still wanted: the same over-sampling margin as at
        the step's start (`over_sampling_batch_size / batch_size`), so replacements of rejected groups run side
        by side rather than one after another."""
        missing = need - accepted
        return -(-missing * self._wanted(need) // need) if missing > 0 else 0

    @staticmethod
    async def _score(pipeline: Pipeline, result: StepResult, outcome: Outcome) -> int:
        group, exports = outcome
        result.groups.append(group)
        result.rows.extend(await pipeline.score_group(group, exports))
        return 0 if group.excluded else 1

    async def _close_step(self, pool: GroupPool, result: StepResult, rollout_id: int, need: int) -> dict[str, float]:
        """Terminate surplus groups and record them; returns extra step metrics."""
        surplus = await pool.cancel_all(SURPLUS)
        for outcome in surplus:
            await self._score(pool.pipeline, result, outcome)
        return {}

    async def before_weight_update(self) -> None:
        return None

    async def after_weight_update(self) -> None:
        return None

    async def close(self) -> None:
        """End whatever is still resident (only after an error or an early stop in sync mode)."""
        if self.pool is not None and self.pool.pending:
            ended = await self.pool.cancel_all("run ended: the group was still resident")
            log.warning("run end: %d resident groups terminated (their sessions are recorded as dropped)",
                        len(ended))
