"""`job=replay replay.bundle=PATH`: re-execute one recorded step's credit and loss from its bundle on the CPU.

The recipe turns the `replay` node and the command line's `credit` node into what the replay re-runs
(`replay/job.py`'s `replay_run`: the folder checked, the bundle's own config with the `credit.*` edits laid over
it) and runs its stages (`replay`). It starts no engine, no agents, no gateway, and writes into no run folder.
"""

from __future__ import annotations

from relax_pipeline.recipes.parts import Job
from relax_pipeline.replay.job import replay, replay_run


def run(job: Job) -> dict[str, float]:
    """Replay the bundle; returns `replay/...` metrics (1.0: identical)."""
    return replay(replay_run(job.config.replay, job.config.credit))
