"""job=train with trainer=deepspeed trainer.num_ranks=2 end to end on the tiny model (gloo on this CPU).

The run is rank 0 (rollout, gateway, engine and its share of training); it starts rank 1, whose log lands
in <output>/trainer_ranks/rank1.log. Two steps: the weights trained by both ranks reach the engine from
rank 0 (step 2's generated tokens carry version 1), the final checkpoint holds rank 0's Hugging Face folder
and both ranks' ZeRO files, and no worker process is left when `run` returns.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax_pipeline.run import run
from relax_pipeline.testing.ray_cluster import local_cluster, require_ray
from tests.e2e.test_train_e2e import train_config

pytest.importorskip("deepspeed")
# slow (about 70 s on 2 cores): tests/integration/test_deepspeed_ranks.py checks the 2-rank step in the default run.
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")]


def test_two_rank_training_run(tmp_path: Path, tiny_path: Path) -> None:
    cfg = train_config(tmp_path, tiny_path, "trainer=deepspeed", "trainer.num_ranks=2", "trainer.zero_stage=2",
                       "rollout.num_steps=2", "rollout.n_samples_per_prompt=2", "trainer.batching.micro_batch_size=1")
    metrics = run(cfg)
    assert metrics["train/weight_version"] == 2 and metrics["train/grad_norm"] > 0
    second = [json.loads(line) for line in (tmp_path / "dump" / "r_1.jsonl").read_text().splitlines()]
    generated = [v for r in second for v, m in zip(r["weight_versions"], r["loss_mask"], strict=True) if m]
    assert generated and set(generated) == {1}
    (checkpoint,) = {p.parent.parent for p in tmp_path.rglob("zero_pp_rank_1_mp_rank_00_optim_states.pt")}
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    assert "Traceback" not in (tmp_path / "trainer_ranks" / "rank1.log").read_text()
    assert not rank_workers(), "a worker rank outlived the run"


def rank_workers() -> list[int]:
    """Children of this process running the rank worker module."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"relax_pipeline.train.rank_worker" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_two_rank_training_run_with_rank_1_on_another_ray_node(tmp_path: Path, tiny_path: Path) -> None:
    """trainer.rank_placement=ray: rank 1 is a Ray actor on the worker node of a local 2-node cluster."""
    require_ray()
    with local_cluster(workers=1, cpus=2, head_cpus=1) as cluster:
        cfg = train_config(tmp_path, tiny_path, "trainer=deepspeed", "trainer.num_ranks=2", "trainer.zero_stage=2",
                           "trainer.rank_placement=ray", "+trainer.rank_resources.node_0=0.5",
                           f"ray.address={cluster.address}", "rollout.num_steps=2",
                           "rollout.n_samples_per_prompt=2", "trainer.batching.micro_batch_size=1")
        metrics = run(cfg)
    assert metrics["train/weight_version"] == 2 and metrics["train/grad_norm"] > 0
    (checkpoint,) = {p.parent.parent for p in tmp_path.rglob("zero_pp_rank_1_mp_rank_00_optim_states.pt")}
    assert (checkpoint / "model.safetensors").is_file()
    log = (tmp_path / "run.log").read_text()
    assert "trainer ranks: rank 1 on node" in log
    assert (tmp_path / "trainer_ranks" / "rank1.log").is_file(), "the rank's log, copied from its node at the end"
