"""Whole runs with `agent.executor=ray` on a local multi-node Ray cluster (`relax_pipeline.testing.ray_cluster`):
a two-step rollout whose sessions run on several nodes, and a node removed mid-step whose sessions are recorded
failed (the error names the node) while the step finishes on the other node and no session goes unrecorded.
Skipped, naming the extra, without Ray (`pip install -e '.[ray]'`)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.run import run
from relax_pipeline.testing.ray_cluster import local_cluster, node_id, require_ray
from tests.e2e.test_e2e_rollout import compose_config, read_dump

NODE = re.compile(r"ray: session (\S+) runs on node \S+ \(([0-9a-f]{12})\)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    require_ray()
    with local_cluster(workers=2, cpus=4, head_cpus=0) as cluster:
        yield cluster


def _placements(output: Path) -> dict[str, str]:
    """Session id → node id prefix, from each session's agent.log."""
    found = {}
    for log in output.glob("sessions/*/agent.log"):
        match = NODE.search(log.read_text(errors="replace"))
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_two_step_rollout_on_two_ray_nodes(tmp_path: Path, tiny_path: Path, cluster: Any) -> None:
    cfg = compose_config(tmp_path, tiny_path, "agent.executor=ray", f"ray.address={cluster.address}",
                         "rollout.num_steps=2", "+agent.resources.num_cpus=1")
    run(cfg)
    rows = [*read_dump(tmp_path / "dump" / "r_0.jsonl"), *read_dump(tmp_path / "dump" / "r_1.jsonl")]
    assert len(rows) == 8 and {r["status"] for r in rows} <= {"completed", "truncated"}
    assert all(r["turn_count"] == 3 and r["reward"] in (0.0, 1.0) for r in rows)
    placements = _placements(tmp_path)
    assert set(placements) == {r["session_id"] for r in rows}
    workers = {node_id(n)[:12] for n in cluster.worker_nodes}
    assert set(placements.values()) == workers, "head_cpus=0 and num_cpus=1: both workers, never the head"


def test_node_removed_mid_step_loses_no_session_record(tmp_path: Path, tiny_path: Path) -> None:
    require_ray()
    with local_cluster(workers=2, cpus=4, head_cpus=0) as cluster:
        doomed = list(cluster.worker_nodes)[0]
        doomed_id = node_id(doomed)[:12]
        remover = threading.Thread(target=_remove_when_busy, args=(cluster, doomed, doomed_id, tmp_path), daemon=True)
        remover.start()
        cfg = compose_config(tmp_path, tiny_path, "agent.executor=ray", f"ray.address={cluster.address}",
                             "+agent.resources.num_cpus=1",
                             "agent.command='sleep 3; exec ${relax_python:} ${relax_root:}/examples/minimal_agent/"
                             "multi_turn.py'")
        run(cfg)
        remover.join(timeout=60)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    placements = _placements(tmp_path)
    assert {r["session_id"] for r in rows} == set(placements), "every started session has a dump row"
    lost = [r for r in rows if r["status"] == "failed"]
    assert lost and all(doomed_id in r["error"] and "was lost" in r["error"] for r in lost)
    assert {placements[r["session_id"]] for r in lost} == {doomed_id}
    completed = [r for r in rows if r["status"] in ("completed", "truncated")]
    assert len(completed) == 4 and all(placements[r["session_id"]] != doomed_id for r in completed)
    log = (tmp_path / "run.log").read_text()
    assert re.search(r"event=accounting_end rollout=0 groups=\d+ rows=\d+ dropped=\d+ filtered=0 failed=[1-9]\d* "
                     r"samples=4 ", log), "the step ends with its 2 groups' 4 samples, the lost node's groups replaced"


def _remove_when_busy(cluster: Any, node: Any, prefix: str, output: Path) -> None:
    """Remove `node` once a session runs on it (its agent sleeps 3 s before its first call)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if prefix in _placements(output).values():
            time.sleep(0.5)
            cluster.remove_node(node)
            return
        time.sleep(0.1)
