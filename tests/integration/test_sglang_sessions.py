"""`engine.sessions=true`: one SGLang session per agent session, through SGLang-wire fakes (in-process, and
launched behind the real smg): turns carry only their new tokens and generate exactly what a plain
request on the whole prompt generates, a fork splices at its offset, `close_session` releases the session on
the server, and a session the server dropped (its timeout) is started again from a root.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.testing.sglang_server import FakeSglangServer

GREEDY = SamplingParams(6, temperature=0.0)


async def _engine(tiny_path: Path, tmp_path: Path, urls: list[str], **options: object) -> SglangEngine:
    engine = SglangEngine(SglangEngineSettings(urls=urls, **options),  # type: ignore[arg-type]
                          EngineRun(str(tiny_path), output_dir=str(tmp_path)))
    await engine.start()
    return engine


async def _turns(engine: SglangEngine, session_id: str | None, n: int = 3) -> list[tuple[int, ...]]:
    """`n` greedy turns of one conversation: each prompt is the last prompt + output + a new observation."""
    prompt, outputs = list(range(3, 30)), []
    for i in range(n):
        result = await engine.generate(prompt, GREEDY, f"{session_id}-t{i}", session_id=session_id)
        outputs.append(result.output_ids)
        prompt = prompt + list(result.output_ids) + [40 + i, 41 + i]
    return outputs


def test_session_turns_send_only_new_tokens_and_generate_as_plain_requests(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = await _engine(tiny_path, tmp_path, [server.url])
            try:
                plain = await _turns(engine, None)
                assert not server.state.sessions.open and engine.step_metrics()["engine/session_turns"] == 0
                served = await _turns(engine, "a")
                metrics = engine.step_metrics()
                assert served == plain, "the session's assembled prompts are the whole prompts"
                assert list(server.state.sessions.open) == ["a"] and metrics["engine/sessions_open"] == 1
                assert metrics["engine/session_turns"] == 3
                # SGLang's cached_tokens is the radix-cache hit: the plain turns cached the first prompt (27)
                assert metrics["engine/session_cached_tokens"] == pytest.approx((27 + 33 + 41) / 3), "kept per turn"
                nodes = server.state.sessions.open["a"].nodes
                assert [len(n.tokens) for n in nodes.values()] == [27 + 6, 27 + 6 + 2 + 6, 27 + 2 * (6 + 2) + 6]
                await engine.close_session("a")
                await engine.close_session("a")  # closing twice is nothing
                assert not server.state.sessions.open and server.state.sessions.closed == 1
                closed = engine.step_metrics()
                assert closed["engine/sessions_open"] == 0 and closed["engine/sessions_closed"] == 1
            finally:
                await engine.close()

    asyncio.run(go())


def test_a_fork_splices_at_its_offset_and_close_at_the_end_releases_every_session(tiny_path: Path,
                                                                                   tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = await _engine(tiny_path, tmp_path, [server.url])
            prompt = list(range(3, 30))
            first = await engine.generate(prompt, GREEDY, "t1", session_id="f")
            fork_prompt = prompt[:20] + [7, 7, 7]
            fork = await engine.generate(fork_prompt, GREEDY, "t2", session_id="f")
            plain = await engine.generate(fork_prompt, GREEDY, "plain")
            assert fork.output_ids == plain.output_ids and fork.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
            assert "POST /generate session_params.offset" in server.state.sent
            node = server.state.sessions.open["f"].nodes["t2"]
            assert node.parent == "t1" and node.tokens == fork_prompt + list(fork.output_ids)
            assert first.output_ids
            await engine.generate(prompt, GREEDY, "other", session_id="g")
            await engine.close()
            assert not server.state.sessions.open and server.state.sessions.closed == 2

    asyncio.run(go())


def test_a_session_the_server_dropped_starts_again_from_a_root(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = await _engine(tiny_path, tmp_path, [server.url], session_timeout_s=30.0)
            try:
                first = await engine.generate(list(range(3, 30)), GREEDY, "t1", session_id="late")
                session = server.state.sessions.open["late"]
                assert session.timeout == 30.0 and session.capacity_of_str_len == engine.max_context_len
                session.last_active -= 31.0  # idle past its timeout: the fake closes it, as SGLang would
                server.state.sessions.reap()
                assert not server.state.sessions.open
                prompt = list(range(3, 30)) + list(first.output_ids) + [5]
                again = await engine.generate(prompt, GREEDY, "t2", session_id="late")
                assert again.output_ids == (await engine.generate(prompt, GREEDY, "plain")).output_ids
                assert list(server.state.sessions.open) == ["late"], "reopened"
                assert server.state.sessions.open["late"].nodes["t2"].parent is None, "the turn went as a root"
            finally:
                await engine.close()

    asyncio.run(go())


def test_sessions_off_sends_plain_requests(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = await _engine(tiny_path, tmp_path, [server.url], sessions=False)
            try:
                await _turns(engine, "x", 2)
                assert engine.sessions is None and server.state.calls["POST /open_session"] == 0
                assert not any("session_params" in entry for entry in server.state.sent)
            finally:
                await engine.close()

    asyncio.run(go())


def test_sessions_through_the_real_smg(tiny_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("smg", reason="pip install -e '.[router]' (smg, the router binary)")

    async def go() -> None:
        settings = SglangEngineSettings(
            launch=True, servers=2, gpus_per_server=0, router="smg",
            launch_command=f"{sys.executable} -m relax_pipeline.testing.sglang_server",
            router_command=f"{sys.executable} -m smg.launch_router", router_args={"log_level": "warn"},
            launch_timeout=120)
        engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
        await engine.start()
        try:
            served = await _turns(engine, "r")
            plain = await _turns(engine, None)
            assert served == plain
            stats = [httpx.get(f"{url}/fake/stats").json() for url in engine._targets.urls]
            assert all(s["sessions_open"] == ["r"] for s in stats), "opened on every worker behind the router"
            assert sum(s["calls"].get("POST /generate", 0) for s in stats) == 6
            await engine.close_session("r")
            stats = [httpx.get(f"{url}/fake/stats").json() for url in engine._targets.urls]
            assert all(s["sessions_open"] == [] and s["sessions_closed"] == 1 for s in stats)
        finally:
            await engine.close()

    asyncio.run(go())


def test_concurrent_first_turns_open_the_session_once(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with FakeSglangServer(tiny_path, session_radix_cache=True) as server:
            engine = await _engine(tiny_path, tmp_path, [server.url])
            try:
                results = await asyncio.gather(*(engine.generate(list(range(3 + i, 30)), GREEDY, f"c{i}",
                                                                 session_id="both") for i in range(3)))
                assert all(r.output_ids for r in results)
                assert server.state.calls["POST /open_session"] == 1
                assert sorted(server.state.sessions.open["both"].nodes) == ["c0", "c1", "c2"]
            finally:
                await engine.close()

    asyncio.run(go())
