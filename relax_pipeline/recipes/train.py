"""`job=train`: rollout, credit, training and weight sync per step; eval every `eval.interval` steps; checkpoints.

The recipe: the run's plan (`parts.Plan`), the agents' folders checked, the trainer built from the `trainer` node,
the engine started behind the gateway, the services started, then `rollout.num_steps` steps of the step loop
(`loop.py`) under the run's stop signals; everything closed at the end (`parts.Teardown`). On the CPU the malloc
arena policy is set first (`allocator`).
"""

from __future__ import annotations

import asyncio

from relax_pipeline.config import Config
from relax_pipeline.recipes.parts import Job, Plan, Teardown, agent_problems, assemble, drive, refuse, trainer_of
from relax_pipeline.train.allocator import (
    bound_cpu_memory,
    cap_kernel_cache,
    keep_freed_cpu_memory,
    wants_freed_memory_kept,
)


def run(job: Job) -> dict[str, float]:
    """Train; returns the last step's metrics plus the latest eval's."""
    allocator(job.config)
    return asyncio.run(train(job))


async def train(job: Job) -> dict[str, float]:
    plan = Plan.of(job.config, job.folder)
    refuse(agent_problems(plan.agents, local_only=True))
    async with Teardown(plan) as teardown:
        loop = await assemble(job, plan, teardown, trainer_of(plan), job.config.rollout.num_steps)
        return await drive(loop, job, plan.services)


def allocator(config: Config) -> None:
    """A training run on the CPU uses one malloc arena, set before the run's own threads start (train/allocator.py):
    the engine then reuses what training frees, and the reverse. `trainer.keep_freed_memory` picks the policy. Its
    oneDNN kernel cache is capped before the first matmul."""
    t = config.trainer
    if t.device.split(":")[0] != "cpu":
        return
    cap_kernel_cache()
    if wants_freed_memory_kept(t.keep_freed_memory, t.device):
        keep_freed_cpu_memory()
    else:
        bound_cpu_memory()
