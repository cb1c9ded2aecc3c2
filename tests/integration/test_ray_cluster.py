"""`testing.ray_cluster.separate_cluster`: the benchmark's cluster runs in a session of its own (so Linux's
autogroup scheduler does not make it share the driver's CPU share), and a driver joins it by its address.
Skipped, naming the extra, without Ray."""

from __future__ import annotations

import os

from relax_pipeline.testing.ray_cluster import require_ray, separate_cluster


def test_the_separate_cluster_runs_in_its_own_session_and_is_joined_by_address() -> None:
    require_ray()
    import ray

    with separate_cluster(workers=1, cpus=1, head_cpus=1) as address:
        ray.init(address=address, include_dashboard=False, logging_level="WARNING")
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        session = ray.remote(num_cpus=0)(lambda: __import__("os").getsid(0))  # by value: no import on the node
        theirs = ray.get(session.remote())
        assert len(nodes) == 2 and theirs != os.getsid(0)
    assert not ray.is_initialized(), "left on exit"
