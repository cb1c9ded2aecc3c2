"""`job=eval`: evaluate `model.path` (a base model or any checkpoint folder) on every `eval.datasets` entry once.

The recipe: the run's plan (`parts.Plan`: its capacity fills the engine's batch, `engine.max_batch_size`, unless
`runtime.eval_concurrency` is set), the agents' folders checked, the engine started behind the gateway, the
services started, then the step loop with no step and no trainer: its eval before the first step, with per-problem
results (`eval_<name>.csv` per dataset, one summary line each); everything closed at the end.
"""

from __future__ import annotations

import asyncio

from relax_pipeline.recipes.parts import Job, Plan, Teardown, agent_problems, assemble, drive, refuse


def run(job: Job) -> dict[str, float]:
    """Evaluate once; returns the eval's metrics."""
    return asyncio.run(evaluate(job))


async def evaluate(job: Job) -> dict[str, float]:
    plan = Plan.of(job.config, job.folder)
    refuse(agent_problems(plan.agents, local_only=True))
    async with Teardown(plan) as teardown:
        loop = await assemble(job, plan, teardown, None, steps=0)
        return await drive(loop, job, plan.services)
