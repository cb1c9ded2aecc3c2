"""`engine.admission=program` through the SGLang-wire fake (in-process, and launched behind the real smg)
and on the embedded engine: a session whose predicted KV does not fit waits until a leased session ends, and
then runs; without admission the fake's small KV pool evicts an idle session's KV and counts its re-prefill,
with program admission it does not. The order of events is awaited, never timed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.program_admission import GrowthModel, hf_capacity_tokens
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.testing.sglang_server import FakeSglangServer

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(6, temperature=0.0)


def prompt(first: int, n: int = 27) -> list[int]:
    return [first] + list(range(3, 2 + n))


async def settle(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def blocked_then_admitted(engine: SglangEngine | HFEngine) -> dict[str, float]:
    """Session a runs a turn; session b's first turn waits until a ends, then runs; the step's metrics."""
    await engine.generate(prompt(40), GREEDY, "a1", session_id="a")
    second = asyncio.create_task(engine.generate(prompt(50), GREEDY, "b1", session_id="b"))
    await asyncio.sleep(0.2)  # time for b to run if it were admitted (the check below does not depend on it)
    assert not second.done(), "b's predicted KV does not fit next to a's lease"
    await engine.close_session("a")
    assert (await asyncio.wait_for(second, 60)).output_ids
    await engine.close_session("b")
    return engine.step_metrics()


def test_sessions_wait_for_room_behind_the_real_smg(tiny_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("smg", reason="pip install -e '.[router]' (smg, the router binary)")

    async def go() -> None:
        settings = SglangEngineSettings(
            launch=True, servers=2, gpus_per_server=0, router="smg", admission="program", kv_headroom=1.0,
            admission_growth_prior=500, server_args={"max_total_num_tokens": 400},
            launch_command=f"{sys.executable} -m relax_pipeline.testing.sglang_server",
            router_command=f"{sys.executable} -m smg.launch_router", router_args={"log_level": "warn"},
            launch_timeout=120)
        engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
        await engine.start()
        try:
            metrics = await blocked_then_admitted(engine)
            assert metrics["agentic_kv/capacity"] == 800, "both servers' max_total_num_tokens"
            assert metrics["agentic_kv/admitted"] == 2 and metrics["agentic_kv/waiting"] == 1
            assert metrics["agentic_kv/fail_open"] == 0 and metrics["agentic_kv/wait_s"] > 0
            assert metrics["agentic_kv/predicted_tokens"] == 527 and metrics["agentic_kv/actual_tokens"] == 33
            stats = [httpx.get(f"{url}/fake/stats").json() for url in engine._targets.urls]
            assert all("GET /metrics" not in s["unknown"] for s in stats)
        finally:
            await engine.close()

    asyncio.run(go())


async def interleaved(engine: SglangEngine, admitted: bool) -> None:
    """Two sessions: a's first turn, b's (awaited without admission; with it, b waits for a to end), a's second."""
    first = await engine.generate(prompt(40), GREEDY, "a1", session_id="a")
    other = asyncio.create_task(engine.generate(prompt(50), GREEDY, "b1", session_id="b"))
    if not admitted:
        await other
    await engine.generate(prompt(40) + list(first.output_ids) + [60, 61], GREEDY, "a2", session_id="a")
    assert not other.done() or not admitted
    await engine.close_session("a")
    await asyncio.wait_for(other, 60)
    await engine.close_session("b")


@pytest.mark.parametrize("admission", ["none", "program"])
def test_an_evicted_session_is_re_prefilled_unless_admission_kept_it(tiny_path: Path, tmp_path: Path,
                                                                     admission: str) -> None:
    async def go() -> dict[str, int]:
        async with FakeSglangServer(tiny_path, capacity=60, ignore_stop=True, session_radix_cache=True) as server:
            engine = SglangEngine(SglangEngineSettings(urls=[server.url], admission=admission, kv_headroom=1.0,
                                                       admission_growth_prior=20),
                                  EngineRun(str(tiny_path), output_dir=str(tmp_path)))
            await engine.start()
            try:
                await interleaved(engine, admission == "program")
                return server.state.stats()
            finally:
                await engine.close()

    stats = asyncio.run(go())
    if admission == "none":
        assert stats["kv_reprefilled_sessions"] == 1 and stats["kv_reprefill_tokens"] == 33
        assert stats["kv_evictions"] >= 1
    else:
        assert stats["kv_reprefilled_sessions"] == 0 and stats["kv_reprefills"] == 0
    assert stats["kv_running_tokens"] == 0 and stats["kv_referenced_tokens"] == 0, "closed sessions dereference it"
    assert stats["kv_idle_tokens"] > 0, "and do not free it: it stays cached until evicted"


def test_the_embedded_engine_admits_sessions_against_its_prefix_cache(tiny_path: Path) -> None:
    async def go() -> None:
        engine = HFEngine(HFEngineSettings(admission="program", kv_cache_mb=1, kv_headroom=1.0),
                          EngineRun(str(tiny_path)))
        await engine.start()
        try:
            capacity = hf_capacity_tokens(engine.model, 2**20)
            assert capacity > 100
            engine.programs.ledger.growth.prior = capacity  # one session's prediction fills the cache
            metrics = await blocked_then_admitted(engine)
            assert metrics["agentic_kv/capacity"] == capacity and metrics["agentic_kv/admitted"] == 2
            assert metrics["agentic_kv/waiting"] == 1 and "engine/decode_steps" in metrics
            waiting = await _aborted_while_waiting(engine)
            assert waiting.finish_reason == "abort" and waiting.output_ids == ()
        finally:
            await engine.close()

    asyncio.run(go())


async def _aborted_while_waiting(engine: HFEngine) -> object:
    """Session d's first turn waits behind c's lease and is aborted there (the ledger forgets what a and b taught it,
    so c's prediction fills the cache again)."""
    engine.programs.ledger.growth = GrowthModel(engine.programs.ledger.growth.prior)
    await engine.generate(prompt(40), GREEDY, "c1", session_id="c")
    late = asyncio.create_task(engine.generate(prompt(50), GREEDY, "d1", session_id="d"))
    await asyncio.sleep(0.2)  # time for d to run if it were admitted
    assert not late.done(), "d's predicted KV does not fit next to c's lease"
    assert (await engine.abort("d1")) is not None
    return await asyncio.wait_for(late, 60)


def test_without_a_prefix_cache_the_embedded_engine_admits_everyone(tiny_path: Path) -> None:
    async def go() -> dict[str, float]:
        engine = HFEngine(HFEngineSettings(admission="program", kv_cache_mb=0), EngineRun(str(tiny_path)))
        await engine.start()
        try:
            await asyncio.gather(*(engine.generate(prompt(40 + i), GREEDY, f"r{i}", session_id=f"s{i}")
                                   for i in range(3)))
            return engine.step_metrics()
        finally:
            await engine.close()

    metrics = asyncio.run(go())
    assert metrics["agentic_kv/fail_open"] == 1 and metrics["agentic_kv/admitted"] == 3
    assert metrics["agentic_kv/waiting"] == 0
