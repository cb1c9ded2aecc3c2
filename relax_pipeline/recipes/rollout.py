"""`job=rollout`: rollout steps, credit and the dump, no training; eval every `eval.interval` steps.

The recipe: the run's plan (`parts.Plan`), the agents' folders checked, the engine started behind the gateway,
the services started, then `rollout.num_steps` steps of the step loop with no trainer, under the run's stop
signals; everything closed at the end.
"""

from __future__ import annotations

import asyncio

from relax_pipeline.recipes.parts import Job, Plan, Teardown, agent_problems, assemble, drive, refuse


def run(job: Job) -> dict[str, float]:
    """Roll out; returns the last step's metrics plus the latest eval's."""
    return asyncio.run(rollout(job))


async def rollout(job: Job) -> dict[str, float]:
    plan = Plan.of(job.config, job.folder)
    refuse(agent_problems(plan.agents, local_only=True))
    async with Teardown(plan) as teardown:
        loop = await assemble(job, plan, teardown, None, job.config.rollout.num_steps)
        return await drive(loop, job, plan.services)
