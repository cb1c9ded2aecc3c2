"""trainer=deepspeed with ranks on a Ray cluster (`trainer.rank_placement=ray`), on a local 2-node cluster and this
CPU (gloo): rank 1 is a Ray actor pinned to the worker node (a custom resource), rank 0 is this process.

One optimizer step of the two ranks equals the 1-rank step (loss, metrics, grad norm, parameters) on the same
batch, with an odd split and a padding micro-batch; rank 1 really ran on the other node. A rank whose actor dies
fails the next step as "died"; a rank whose call raises fails it with `RankFailed` naming the rank, its node, the
error and its log; closing the trainer copies the rank's log into the output folder and ends the actor. Skipped
without Ray or DeepSpeed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.forest.sample import Sample
from relax_pipeline.testing.ray_cluster import joined_cluster, node_id
from tests.integration.test_deepspeed_ranks import ADVANTAGES, BATCH, COMPARED, LR, SETTINGS, one_step
from tests.integration.test_trainer import assert_weights

pytest.importorskip("deepspeed")
from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer  # noqa: E402
from relax_pipeline.train.rank_group import RankFailed  # noqa: E402
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
ON_WORKER = {"num_cpus": 1, "node_0": 0.5}
"""Rank 1's resources: one CPU on the worker node (`node_0`, which only that node has)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with joined_cluster(workers=1, cpus=2, head_cpus=1) as cluster:
        yield cluster


def on_ray(tiny_path: Path, output_dir: Path | None = None) -> DeepSpeedTrainer:
    settings = DeepSpeedSettings(zero_stage=2, num_ranks=2, rank_placement="ray", rank_resources=ON_WORKER, **SETTINGS)
    return DeepSpeedTrainer(settings, TrainerRun(str(tiny_path), advantages=ADVANTAGES,
                                                 output_dir=None if output_dir is None else str(output_dir)))


def test_a_rank_on_another_node_takes_the_same_step_as_one_rank(tiny_path: Path, cluster: Any) -> None:
    one, one_weights = one_step(tiny_path, 2, 1)
    t = on_ray(tiny_path)
    try:
        assert t.ranks is not None and t.ranks.nodes[0].endswith(f"({node_id(next(iter(cluster.worker_nodes)))[:12]})")
        two = t.train(BATCH)
        two_weights = t.engine_weights()
    finally:
        t.close()
    for key in COMPARED:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert_weights(one_weights, two_weights, atol=LR / 10)


def test_a_rank_that_raises_fails_the_call_naming_rank_node_and_log(tiny_path: Path, tmp_path: Path,
                                                                    cluster: Any) -> None:
    import ray

    bad = Sample((10, 11, 10**7, 12), 2, (1, 1), (-1.0, -1.0), advantage=1.0)  # token id beyond the vocabulary
    t = on_ray(tiny_path, tmp_path)
    actor = t.ranks.actors[0] if t.ranks else None
    try:
        with pytest.raises(RankFailed) as failure:
            t.train([BATCH[0], bad])  # sample 1 goes to rank 1
        with pytest.raises(RankFailed, match="trainer rank 1"):
            t.train(BATCH)  # the group stays failed
    finally:
        t.close()
    message = str(failure.value)
    assert "trainer rank 1 (Ray actor on node " in message and "raised during 'train'" in message
    assert "IndexError" in message and re.search(r"relax-trainer-rank-\w+/rank1\.log", message)
    assert "IndexError" in (tmp_path / "trainer_ranks" / "rank1.log").read_text(), "closing copied its log here"
    node_log = re.search(r"its log on that node: (\S+)", message)
    assert node_log and not Path(node_log.group(1)).exists(), "and removed it from the node"
    assert actor is not None and t.ranks is None
    assert ended(ray, actor), "closing the trainer ended the actor"


def test_a_lost_rank_fails_the_next_step_as_died(tiny_path: Path, cluster: Any) -> None:
    import ray

    t = on_ray(tiny_path)
    try:
        assert t.ranks is not None
        ray.kill(t.ranks.actors[0])  # as when its node goes away
        with pytest.raises(RankFailed, match=r"trainer rank 1 \(Ray actor on node .*\) died \(\w+\) during 'train'"):
            t.train(BATCH)
    finally:
        t.close()


def ended(ray: Any, actor: Any, within_s: float = 30.0) -> bool:
    """Whether the actor is gone within `within_s` (ray.kill takes effect asynchronously). Polled with `log_path`,
    which reads no file: closing may already have removed the rank's log while the actor still answers."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.log_path.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


def test_ray_placement_needs_several_ranks(tiny_path: Path) -> None:
    with pytest.raises(ValueError, match="trainer.rank_placement=ray places ranks 1..N-1 on a Ray cluster"):
        DeepSpeedTrainer(DeepSpeedSettings(num_ranks=1, rank_placement="ray"), TrainerRun(str(tiny_path)))
    with pytest.raises(ValueError, match="trainer.rank_placement='k8s'; choose one of local, ray"):
        DeepSpeedTrainer(DeepSpeedSettings(num_ranks=2, rank_placement="k8s"), TrainerRun(str(tiny_path)))
