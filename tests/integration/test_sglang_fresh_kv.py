"""engine=sglang by SGLang 0.5.23's own semantics, through the SGLang-wire fake that follows them
(`testing/sglang_server.py`, `testing/kv_pool.py`): the cache after a weight update, and sessions' KV.

Fix 1 (fresh KV after every update): SGLang flushes its radix cache after a load only when the load asks
(`flush_cache`), and a paused update must not ask (the flush would fail while requests run). The fake flushes only
when asked and counts every prefix served from KV older weights computed (`kv_stale_hits`): a request sent after a
paused update shares a cached prompt, and no stale prefix is served, because every request names its weight
version's `cache_salt`. Fix 2 (sessions that hold KV): the engine launches servers with
`--enable-session-radix-cache`, refuses running servers without it (or falls back, as `engine.sessions_fallback`
says), and a closed session's KV is dereferenced, not freed: it stays cached for the next prompt that shares it.
Bad settings are refused naming the key (`engine.router=sglang`, `engine.router=smg` without smg), and an image
prompt SGLang served at another length is counted or refused (`engine.image_mismatch`).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine, SglangError
from relax_pipeline.testing.sglang_server import FakeSglangServer

pytestmark = pytest.mark.integration
GREEDY = SamplingParams(6, temperature=0.0)
PROMPT = list(range(3, 40))


def _weights(tiny_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()


def _engine(tiny_path: Path, tmp_path: Path, urls: list[str], **options: object) -> SglangEngine:
    return SglangEngine(SglangEngineSettings(urls=urls, **options),  # type: ignore[arg-type]
                        EngineRun(str(tiny_path), output_dir=str(tmp_path)))


@pytest.mark.parametrize("transfer", ["disk", "tensor"])
def test_after_a_paused_update_no_prefix_is_served_from_old_weights_kv(tiny_path: Path, tmp_path: Path,
                                                                      transfer: str) -> None:
    async def go() -> tuple[dict, list[int]]:
        async with FakeSglangServer(tiny_path, decode_delay_s=0.01, session_radix_cache=True) as server:
            engine = _engine(tiny_path, tmp_path, [server.url], weight_update="pause", weight_transfer=transfer)
            await engine.start()
            try:
                cached = [await _cached(engine, server, "warm"), await _cached(engine, server, "before")]
                long = asyncio.create_task(engine.generate(PROMPT + [9], SamplingParams(60, seed=1), "through"))
                await asyncio.sleep(0.2)
                await engine.update_weights(_weights(tiny_path), 1)
                through = await long
                cached += [await _cached(engine, server, "after"), await _cached(engine, server, "again")]
                assert through.finish_reason != "abort" and through.token_versions[-1] == 1, "went on through it"
                return server.state.stats(), cached
            finally:
                await engine.close()

    stats, cached = asyncio.run(go())
    assert stats["kv_flushes"] == 0, "a paused update asks for no flush (SGLang would fail it while requests run)"
    assert stats["kv_stale_hits"] == 0 and stats["kv_stale_tokens"] == 0, "no prefix of the old weights served"
    assert cached[1] >= len(PROMPT), "the cache serves the prompt before the update"
    assert cached[2] == 0 and cached[3] >= len(PROMPT), "after it, the new version's cache fills and serves it"


async def _cached(engine: SglangEngine, server: FakeSglangServer, rid: str) -> int:
    """Generate PROMPT; the prompt tokens the server served from its cache."""
    before = server.state.pool.counts["cached_tokens"]
    await engine.generate(PROMPT, GREEDY, rid)
    return server.state.pool.counts["cached_tokens"] - before


def test_an_update_that_asks_for_a_flush_while_requests_run_fails_as_sglangs(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, decode_delay_s=0.02, session_radix_cache=True) as server:
            engine = _engine(tiny_path, tmp_path, [server.url])  # weight_update=abort: the load flushes
            await engine.start()
            try:
                task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(200, seed=1), "running"))
                await asyncio.sleep(0.3)
                with pytest.raises(SglangError, match="the cache was not flushed because requests are still running"):
                    await engine.update_weights(_weights(tiny_path), 1)
                await engine.abort("running")
                await task
                await engine.update_weights(_weights(tiny_path), 2)
                assert server.state.pool.counts["flushes"] == 1, "idle: the flush the abort mode asks for is done"
            finally:
                await engine.close()

    asyncio.run(go())


def test_launched_servers_get_the_session_radix_cache_flag(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> dict:
        settings = SglangEngineSettings(launch=True, servers=1, gpus_per_server=0, launch_timeout=120,
                                        launch_command=f"{sys.executable} -m relax_pipeline.testing.sglang_server")
        engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
        await engine.start()
        try:
            assert engine.sessions is not None
            return httpx.get(f"{engine._targets.urls[0]}/server_info").json()
        finally:
            await engine.close()

    assert asyncio.run(go())["enable_session_radix_cache"] is True


def test_running_servers_without_the_flag_are_refused_or_fallen_back_from(tiny_path: Path, tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path) as server:  # SGLang's default: no --enable-session-radix-cache
            refused = _engine(tiny_path, tmp_path, [server.url])
            with pytest.raises(SglangError, match="engine.sessions=true.*--enable-session-radix-cache.*"
                                                  "engine.sessions_fallback=true"):
                await refused.start()
            fallen = _engine(tiny_path, tmp_path, [server.url], sessions_fallback=True)
            await fallen.start()
            try:
                assert fallen.sessions is None
                await fallen.generate(PROMPT, GREEDY, "t1", session_id="s")
                assert server.state.calls["POST /open_session"] == 0, "a plain request"
            finally:
                await fallen.close()

    asyncio.run(go())
    assert "engine.sessions_fallback=true: running with engine.sessions=false" in caplog.text


def test_a_closed_session_is_dereferenced_not_freed(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> tuple[dict, dict, int]:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = _engine(tiny_path, tmp_path, [server.url])
            await engine.start()
            try:
                first = await engine.generate(PROMPT, GREEDY, "t1", session_id="s")
                held = server.state.stats()
                await engine.close_session("s")
                closed = server.state.stats()
                before = server.state.pool.counts["cached_tokens"]
                await engine.generate(PROMPT + list(first.output_ids) + [7], GREEDY, "later")
                return held, closed, server.state.pool.counts["cached_tokens"] - before
            finally:
                await engine.close()

    held, closed, reused = asyncio.run(go())
    context = len(PROMPT) + 6
    assert held["kv_referenced_tokens"] == context, "an open session references its KV"
    assert closed["kv_referenced_tokens"] == 0 and closed["kv_idle_tokens"] == context, "dereferenced, still cached"
    assert reused == context, "a later prompt that shares it is served from it"


def test_bad_router_settings_are_refused_naming_the_key(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine.router='sglang'.*engine.router=smg"):
        SglangEngineSettings(urls=["http://x"], router="sglang")

    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = _engine(tiny_path, tmp_path, [server.url], router="smg",
                             router_command=f"{sys.executable} -m no_such_router_module")
            with pytest.raises(ValueError, match=r"engine.router=smg .*engine.router_command.*\[router\]"):
                await engine.start()

    asyncio.run(go())


def test_an_image_prompt_served_at_another_length_is_counted_or_refused(tiny_vl_path: Path) -> None:
    from relax_pipeline.engine.sglang.media import SglangVision

    vision = SglangVision.load(tiny_vl_path)
    assert vision is not None
    vision.served({"prompt_tokens": 12}, 12, "http://s")
    vision.served({"prompt_tokens": 13}, 12, "http://s")
    assert vision.take_metrics() == {"engine/image_token_mismatches": 1.0}
    assert vision.take_metrics() == {"engine/image_token_mismatches": 0.0}, "per step"
    with pytest.raises(ValueError, match="engine.image_mismatch=refuse"):
        vision.served({"prompt_tokens": 11}, 12, "http://s", refuse=True)
