"""A local multi-node Ray cluster for tests and benchmarks: `ray.cluster_utils.Cluster`, every node on this machine.

`with local_cluster(workers=2, cpus=4) as cluster:` starts a head node and `workers` worker nodes (each its own
raylet with `cpus` logical CPUs and the custom resource `node_<i>: 1`), waits until all are up, and shuts it all
down at the end. `cluster.address` is what `ray.address` takes; `cluster.worker_nodes` are the nodes a test may
`remove_node` (a lost node). `node_id(node)` is the id `agent/ray_executor` names a node by (its first 12 hex
digits appear in the session's agent.log and in a lost session's error).

`with separate_cluster(workers=1, cpus=2) as address:` is the same cluster run by a helper process in its own
session, for benchmarks: with Linux's autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`) CPU time is
shared fairly between sessions, and a cluster started in-process puts every Ray daemon and worker (raylets, GCS,
the agent runners) in the driver's session, so on a busy machine the driver (the gateway) and the nodes split one
share, which separate machines never do. The helper's cluster is only reachable by its address (no `remove_node`).

Skip helper: `require_ray()` skips the calling test, naming the extra, when Ray is not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
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


@contextlib.contextmanager
def joined_cluster(workers: int = 1, cpus: int = 2, head_cpus: int = 1) -> Iterator[Any]:
    """`local_cluster` with this process joined to it (`ray.init`), as a module-scoped test fixture wants it; Ray
    is left at the end (`ray_runtime.shutdown`)."""
    require_ray()
    import ray

    from relax_pipeline.infra import ray_runtime

    with local_cluster(workers, cpus, head_cpus) as cluster:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        try:
            yield cluster
        finally:
            ray_runtime.shutdown()


@contextlib.contextmanager
def separate_cluster(workers: int = 2, cpus: int = 4, head_cpus: int = 2) -> Iterator[str]:
    """`local_cluster` run by a helper process in its own session (see the module); yields the address."""
    code = ("import sys; from relax_pipeline.testing.ray_cluster import local_cluster\n"
            f"with local_cluster({workers}, {cpus}, {head_cpus}) as c:\n"
            "    print(c.address, flush=True); sys.stdin.read()")
    helper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert helper.stdin is not None and helper.stdout is not None
    try:
        address = helper.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the helper that starts the Ray cluster exited ({helper.wait()}); see its stderr")
        yield address
    finally:
        _leave_ray()
        helper.stdin.close()
        try:
            helper.wait(timeout=120)
        except subprocess.TimeoutExpired:
            helper.kill()


def node_id(node: Any) -> str:
    """The node's Ray id (hex)."""
    return str(node.node_id)


def _leave_ray() -> None:
    """Disconnect this process from Ray if a run left it connected."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
