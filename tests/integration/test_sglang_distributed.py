"""`engine.weight_transfer=distributed` on the CPU: a real weight update through a process group (backend gloo).

Two SGLang-wire fakes are launched as their own processes (as SGLang servers are) behind the real smg;
the client joins them in one weight-update group as rank 0 (`/init_weights_update_group`), then each update sends
`/update_weights_from_distributed` per bucket while it broadcasts the tensors. The served model must then be
exactly the new weights: greedy tokens and logprobs equal an embedded engine's loaded with them. The fields the
client sent (the fakes record them) must be fields of the pinned SGLang release (the conformance test's reader).
Refusals at start name the key.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.engine.sglang.weights import GroupPlan, check_transfer, distributed_body
from tests.integration.test_sglang_conformance import read_api, wheel_path
from tests.integration.test_sglang_engine import GREEDY, _moved_weights

pytestmark = pytest.mark.integration


def _settings(**options: Any) -> SglangEngineSettings:
    return SglangEngineSettings(
        launch=True, servers=2, gpus_per_server=0, router="smg",
        launch_command=f"{sys.executable} -m relax_pipeline.testing.sglang_server", router_args={"log_level": "warn"},
        router_command=f"{sys.executable} -m smg.launch_router", launch_timeout=120,
        weight_transfer="distributed", weight_backend="gloo", **options)


async def _stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/fake/stats")).json()


async def _exactly(tiny_path: Path, weights: dict[str, Any], prompt: list[int]) -> Any:
    direct = HFEngine(HFEngineSettings(), EngineRun(str(tiny_path), seed=0))
    await direct.start()
    try:
        await direct.update_weights(weights, 1)
        return await direct.generate(prompt, GREEDY, "direct")
    finally:
        await direct.close()


def test_distributed_transfer_broadcasts_new_weights_behind_the_real_router(tiny_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("smg", reason="pip install -e '.[router]' (smg, the router binary)")
    weights = _moved_weights(tiny_path)
    prompt = list(range(3, 30))

    async def go() -> list[dict[str, Any]]:
        engine = SglangEngine(_settings(), EngineRun(str(tiny_path), output_dir=str(tmp_path)))
        await engine.start()
        try:
            before = await engine.generate(prompt, GREEDY, "b")
            await engine.update_weights(weights, 1)
            after = await engine.generate(prompt, GREEDY, "a")
            await engine.update_weights(weights, 2)  # the group is made once and serves every update
            want = await _exactly(tiny_path, weights, prompt)
            assert after.logprobs[0] != pytest.approx(before.logprobs[0], abs=1e-4), "new weights serve"
            assert after.output_ids == want.output_ids and after.logprobs == pytest.approx(want.logprobs, abs=1e-5)
            assert after.weight_version == 1 and engine.weight_version == 2
            return [await _stats(url) for url in engine._targets.urls]
        finally:
            await engine.close()

    stats = asyncio.run(go())
    assert [s["weight_version"] for s in stats] == ["2", "2"]
    assert [s["calls"].get("POST /init_weights_update_group") for s in stats] == [1, 1]
    assert all(s["calls"].get("POST /update_weights_from_distributed", 0) >= 2 for s in stats)
    assert all(s["unknown"] == [] for s in stats)
    assert not (tmp_path / "sglang" / "weights").exists(), "nothing is written to disk"
    sent = {e for s in stats for e in s["sent"] if not e.startswith("POST /generate ")}  # the router adds to those
    assert {"POST /init_weights_update_group rank_offset", "POST /update_weights_from_distributed shapes",
            "POST /update_weights_from_distributed weight_version"} <= sent
    assert read_api(wheel_path()).refusals(sent) == [], "the client sends only what SGLang 0.5.23 accepts"


def test_the_group_plan_gives_each_server_its_ranks_and_bodies_name_dtypes_as_sglang_reads_them(
        tiny_path: Path) -> None:
    plan = GroupPlan.of(["http://127.0.0.1:1", "http://127.0.0.1:2"], [2, 1], "gloo", None)
    assert plan.address == "127.0.0.1" and plan.offsets == (1, 3) and plan.world_size == 4
    assert plan.body(1) == {"master_address": "127.0.0.1", "master_port": plan.port, "rank_offset": 3,
                            "world_size": 4, "group_name": "relax_weight_update", "backend": "gloo"}
    bucket = list(_moved_weights(tiny_path).items())[:2]
    last = distributed_body(bucket, 7, True)
    assert last["dtypes"] == ["float32", "float32"] and last["shapes"] == [list(t.shape) for _, t in bucket]
    assert last["weight_version"] == "7" and last["flush_cache"] is True
    assert "weight_version" not in distributed_body(bucket, None, True) and not distributed_body(bucket, None, True)[
        "flush_cache"], "only the last bucket sets the version and flushes"


def test_distributed_transfer_refusals_name_the_key() -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="engine.weight_backend=nccl .* needs CUDA.*engine.weight_backend=gloo"):
            check_transfer("distributed", "nccl")
        check_transfer("distributed", None)  # resolves to gloo on a machine without CUDA
    with pytest.raises(ValueError, match="engine.weight_backend"):
        SglangEngineSettings(urls=["http://x"], weight_transfer="distributed", weight_backend="mpi")
