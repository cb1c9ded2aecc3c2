"""Hydra sweeps on Ray: `python -m relax_pipeline -m hydra/launcher=ray ...` runs each sweep job as a Ray task
(the `hydra-ray-launcher` plugin, on a local Ray instance it starts), each job writing its own output folder.
Skipped, naming the extra, without Ray or the plugin (`pip install -e '.[ray]'`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_pipeline.testing.ray_cluster import RAY_EXTRA, require_ray


@pytest.mark.slow  # about 20 s: a Ray instance for a two-job job=check sweep
def test_two_job_sweep_runs_on_ray(tmp_path: Path, tiny_path: Path) -> None:
    require_ray()
    if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip(f"hydra-ray-launcher is not installed: {RAY_EXTRA}")
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "relax_pipeline", "-m", "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
         "+hydra.launcher.ray.init.include_dashboard=false", "job=check", f"model.cache_dir={tiny_path.parent}",
         "rollout.batch_size=1,2", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=280, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(_run_job pid=" in result.stderr, "the jobs ran as Ray tasks"
    for job in ("0", "1"):
        log = (sweep / job / "run.log").read_text()
        assert "check: OK" in log
    first, second = ((sweep / j / "run.log").read_text() for j in ("0", "1"))
    assert "resident_sessions = 8" in first
    assert "resident_sessions = 16" in second, "the second job has twice the first job's batch"
