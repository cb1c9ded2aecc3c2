"""`engine=sglang engine.launch=true engine.placement=ray`: two SGLang-wire fake servers placed on a local two-node
Ray cluster through a placement group of CPU bundles (one per node with STRICT_SPREAD); generations reach both,
their logs come back and the group is removed at close; a group the cluster cannot hold fails naming the
bundles. Skipped, naming the extra, without Ray."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.testing.ray_cluster import local_cluster, require_ray

FAKE = f"{sys.executable} -m relax_pipeline.testing.sglang_server"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    require_ray()
    with local_cluster(workers=2, cpus=2, head_cpus=0) as cluster:
        yield cluster


def test_servers_placed_on_two_nodes_by_a_placement_group(tiny_path: Path, tmp_path: Path, cluster: Any) -> None:
    settings = SglangEngineSettings(launch=True, servers=2, gpus_per_server=0, launch_command=FAKE,
                                    placement_strategy="STRICT_SPREAD", launch_timeout=180)
    run = EngineRun(str(tiny_path), ray={"address": cluster.address}, output_dir=str(tmp_path))
    engine = SglangEngine(settings, run)
    assert engine.placement == "ray", "ray.address set and launch=true: placed on Ray by default"

    async def go() -> set[str]:
        await engine.start()
        try:
            import ray

            table = ray.util.placement_group_table(engine.ray_servers.group)
            assert len(set(table["bundles_to_node_id"].values())) == 2, "STRICT_SPREAD: one bundle per node"
            prompt = list(range(3, 30))
            results = await asyncio.gather(*(engine.generate(prompt, SamplingParams(4, seed=i), f"r{i}")
                                             for i in range(6)))
            assert all(len(r.output_ids) == 4 for r in results)
            return set(engine.server_info)
        finally:
            await engine.close()

    urls = asyncio.run(go())
    assert len(urls) == 2
    logs = sorted(p.name for p in (tmp_path / "sglang").glob("server_*.log"))
    assert logs == ["server_0.log", "server_1.log"]
    assert engine.ray_servers.group is None and engine.ray_servers.hosts == []


def test_a_placement_the_cluster_cannot_hold_fails_naming_the_bundles(tiny_path: Path, tmp_path: Path,
                                                                      cluster: Any) -> None:
    settings = SglangEngineSettings(launch=True, servers=1, gpus_per_server=1, launch_command=FAKE, placement="ray",
                                    launch_timeout=3)
    run = EngineRun(str(tiny_path), ray={"address": cluster.address}, output_dir=str(tmp_path))
    engine = SglangEngine(settings, run)
    with pytest.raises(RuntimeError, match=r"could not reserve 1 x \{'CPU': 1.0, 'GPU': 1\}.*engine.gpus_per_server"):
        asyncio.run(engine.start())


def test_placement_ray_without_launch_names_the_key(tiny_path: Path) -> None:
    with pytest.raises(ValueError, match="engine.placement=ray places launched servers"):
        SglangEngineSettings(urls=["http://127.0.0.1:1"], placement="ray")
