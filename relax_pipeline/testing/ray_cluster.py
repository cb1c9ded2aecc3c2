"""A local multi-node Ray cluster for tests and benchmarks: `ray.cluster_utils.Cluster`, every node on this machine.

`with local_cluster(workers=2, cpus=4) as cluster:` starts a head node and `workers` worker nodes (each its own
raylet with `cpus` logical CPUs and the custom resource `node_<i>: 1`), waits until all are up, and shuts it all
down at the end. `cluster.address` is what `ray.address` takes; `cluster.worker_nodes` are the nodes a test may
`remove_node` (a lost node). `node_id(node)` is the id `agent/ray_executor` names a node by (its first 12 hex
digits appear in the session's agent.log and in a lost session's error).

Skip helper: `require_ray()` skips the calling test, naming the extra, when Ray is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

RAY_EXTRA = "pip install -e '.[ray]'"
"""What installs Ray for these tests."""


def require_ray() -> None:
    """Skip the calling test when Ray is not installed (the message names the extra)."""
    if importlib.util.find_spec("ray") is None:
        import pytest

        pytest.skip(f"Ray is not installed: {RAY_EXTRA}")


@contextlib.contextmanager
def local_cluster(workers: int = 2, cpus: int = 4, head_cpus: int = 2) -> Iterator[Any]:
    """A head node plus `workers` worker nodes on this machine (see the module); shut down on exit."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    try:
        for index in range(workers):
            cluster.add_node(num_cpus=cpus, resources={f"node_{index}": 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        _leave_ray()
        cluster.shutdown()


def node_id(node: Any) -> str:
    """The node's Ray id (hex)."""
    return str(node.node_id)


def _leave_ray() -> None:
    """Disconnect this process from Ray if a run left it connected."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
