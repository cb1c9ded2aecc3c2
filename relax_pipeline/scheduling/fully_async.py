"""`runtime=fully_async`: generation and training overlap; steps take whatever groups finished.

The pool is kept full: whenever a group's worth of agent slots is free (a slot per session, given back as each
session's agent ends), another group is launched (at most one step's worth of finished groups waiting), during rollout,
training and eval alike. A step takes the next `rollout.batch_size` finished groups in completion order
(scoring them, replacing dropped and filtered ones as they come). Around each weight update every
in-flight generation is preempted (aborted, its partial tokens kept) and resumed on the new weights, so
a sample's tokens can span versions and carry each one. `runtime.max_staleness` bounds how many versions
old a group's first generated token may be when its step takes it: older groups are dropped ("stale"),
counted in `rollout/stale_groups`, and their prompts go back to the data source. The last step launches
nothing new and drains every resident group into its batch, so no session is left running.
"""

from __future__ import annotations

import logging
import time

from relax_pipeline.scheduling.base import Binding
from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.scheduling.sync import SyncRuntime
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline, StepResult
from relax_pipeline.turn.sessions import Session

log = logging.getLogger(__name__)


class FullyAsyncRuntime(SyncRuntime):
    """Continuous generation; steps consume finished groups; preemption only around weight updates."""

    retains_train_sessions = True
    """Train sessions stay alive while eval runs (the capacity check adds their slots)."""

    reads_staleness = True

    def __init__(self, settings: RuntimeSettings) -> None:
        super().__init__(settings)
        self.max_staleness = settings.max_staleness
        """Drop groups whose first token is more than this many weight versions old; None: no bound."""

    def bind(self, binding: Binding) -> None:
        super().bind(binding)
        # the step new groups belong to, groups a step takes, new groups start leased, the last step drains
        self._step, self._need = 0, 1
        self._leased, self._draining = True, False

    async def rollout(self, pipeline: Pipeline, rollout_id: int) -> StepResult:
        started = time.time()
        pipeline.source.new_step()
        pool = self._pool(pipeline)
        pool.on_done = self._refill
        self._step, self._need, self._draining = rollout_id, pipeline.batch_size, self._is_last(rollout_id)
        self._refill()
        result, stale = StepResult(rollout_id), 0
        accepted = 0
        while accepted < self._need or (self._draining and pool.pending):
            outcome = await pool.next_done()
            if outcome is None:
                break
            stale += await self._drop_if_stale(pipeline, outcome[0])
            accepted += await self._score(pipeline, result, outcome)
        if accepted < self._need:
            log.warning("rollout %d: only %d of %d groups finished", rollout_id, accepted, self._need)
        result.groups.sort(key=lambda g: g.id)
        closed = await pipeline.close_step(result, started)
        closed.metrics["rollout/stale_groups"] = float(stale)
        return closed

    def _refill(self) -> None:
        """Keep the agent slots full (a group starts as soon as a group's worth is free, its siblings still
        finishing), with at most one step's worth of finished groups waiting."""
        pool = self.pool
        if pool is None or pool.closing or self._draining or pool.pipeline.stopped:
            return
        for _ in range(pool.room if pool.ready < self._need else 0):
            pool.launch(self._step, leased=self._leased)

    async def _drop_if_stale(self, pipeline: Pipeline, group: Group) -> int:
        if self.max_staleness is None or group.excluded or self.binding is None:
            return 0
        firsts = [v for s in group.sessions if (v := _first_version(s)) is not None]
        now = self.binding.engine.weight_version
        if not firsts or now - min(firsts) <= self.max_staleness:
            return 0
        await pipeline.cancel_group(group, f"stale: its first token came from weights v{min(firsts)} and the policy "
                                           f"is v{now} (runtime.max_staleness={self.max_staleness})")
        return 1

    async def before_weight_update(self) -> None:
        """Preempt every in-flight generation; it resumes on the new weights (unless the engine keeps generations
        running through the update, `Engine.in_flight_updates`: engine=sglang engine.weight_update=pause)."""
        if self.binding is not None and self.binding.engine.in_flight_updates:
            return
        self._leased = False
        if self.pool is not None:
            aborted = await self.pool.revoke_all()
            log.info("weight update: %d in-flight generations preempted", aborted)

    async def after_weight_update(self) -> None:
        if self.binding is not None and self.binding.engine.in_flight_updates:
            return
        self._leased = True
        if self.pool is not None:
            self.pool.grant_all()


def _first_version(session: Session) -> int | None:
    """Weight version of the session's first generated token, None before it generated."""
    for node in session.forest.nodes:
        if node.kind == "response" and node.weight_versions:
            return node.weight_versions[0]
    return None

