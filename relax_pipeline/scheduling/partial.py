"""`runtime=partial`: request-level partial rollout; unfinished groups carry over to the next step.

Each step collects `rollout.batch_size` groups as under `sync`. At step close, instead of terminating the
groups that are still running, it parks them: every in-flight generation is aborted and the engine's
partial tokens are kept by the turn service, whose HTTP request stays open (SSE heartbeats go on); the
sessions' active-time clocks pause. The next step leases the parked groups first: each held generation
resumes with its partial tokens appended to the prompt and the remaining token budget, and the agent
receives one normal response whose tokens carry the weight versions that produced them. A request
aborted `runtime.max_aborted_count` times is protected: step close waits for that generation to finish
instead of aborting it again. Sessions not generating at step close (an agent busy in a tool) simply
carry over. The last step ends its surplus as `sync` does, so nothing is left behind.
"""

from __future__ import annotations

import logging

from relax_pipeline.scheduling.pool import GroupPool
from relax_pipeline.scheduling.sync import SyncRuntime
from relax_pipeline.stages.pipeline import StepResult

log = logging.getLogger(__name__)


class PartialRuntime(SyncRuntime):
    """Sync steps whose unfinished groups are parked and resumed instead of terminated."""

    retains_train_sessions = True
    """Train sessions stay alive while eval runs (the capacity check adds their slots)."""

    def _open_step(self, pool: GroupPool, rollout_id: int, need: int) -> int:
        resumed = pool.grant_all()
        if resumed:
            log.info("rollout %d: resumed %d parked groups", rollout_id, resumed)
        return super()._open_step(pool, rollout_id, need)

    async def _close_step(self, pool: GroupPool, result: StepResult, rollout_id: int, need: int) -> dict[str, float]:
        if self._is_last(rollout_id):
            return await super()._close_step(pool, result, rollout_id, need)
        parked = len(pool.running)
        aborted = await pool.revoke_all()
        log.info("rollout %d: parked %d unfinished groups (%d generations aborted, resumed next step)",
                 rollout_id, parked, aborted)
        return {"rollout/parked_groups": float(parked), "rollout/aborted_generations": float(aborted)}
