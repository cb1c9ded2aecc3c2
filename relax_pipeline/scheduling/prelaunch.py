"""`runtime=prelaunch`: start the next step's agents while the trainer works.

Each step runs as under `sync`. Once it has its groups and the surplus is ended, the resident capacity
is free, so the next step's groups are launched at once, held: their agent processes start (paying their
start-up cost during the optimizer step, the weight update and eval), their sessions wait with paused
active-time clocks, and their first requests are held by the group lease. The next step leases them
first and launches only what is still missing. Nothing is prelaunched after the last step; groups still
held when the run ends are terminated, recorded as dropped, and their prompts go back to the source.
With `runtime.partial_rollout` too (`PrelaunchPartialRuntime`), step close parks the unfinished groups first and
prelaunches only into the capacity they leave.
"""

from __future__ import annotations

import logging

from relax_pipeline.scheduling.partial import PartialRuntime
from relax_pipeline.scheduling.pool import GroupPool
from relax_pipeline.scheduling.sync import SyncRuntime
from relax_pipeline.stages.pipeline import StepResult

log = logging.getLogger(__name__)


class PrelaunchRuntime(SyncRuntime):
    """Sync steps plus agent start-up hidden behind the previous step's training."""

    retains_train_sessions = True
    """Train sessions stay alive while eval runs (the capacity check adds their slots)."""

    def _open_step(self, pool: GroupPool, rollout_id: int, need: int) -> int:
        held = pool.grant_all()
        return held + super()._open_step(pool, rollout_id, need)

    async def _close_step(self, pool: GroupPool, result: StepResult, rollout_id: int, need: int) -> dict[str, float]:
        extra = await super()._close_step(pool, result, rollout_id, need)
        if self._is_last(rollout_id) or pool.pipeline.stopped:
            return extra
        count = max(0, min(self._wanted(need), pool.capacity) - pool.pending)  # parked groups (partial) count
        for _ in range(count):
            pool.launch(rollout_id + 1, leased=False)
        log.info("rollout %d: prelaunched %d groups for the next step", rollout_id, count)
        return {**extra, "rollout/prelaunched_groups": float(count)}


class PrelaunchPartialRuntime(PrelaunchRuntime, PartialRuntime):
    """`runtime.prelaunch=true runtime.partial_rollout=true`: unfinished groups are parked at step close, and the
    next step's agents fill the rest of the resident capacity while the trainer works; the next step resumes the
    parked groups and leases the prelaunched ones first."""
