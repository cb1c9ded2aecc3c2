"""`engine=sglang` against SGLang-wire fake servers (real HTTP on 127.0.0.1, real tokens from the tiny model).

Every fake records the endpoints it was asked for; a call to one it does not implement (so one the SGLang
version it follows lacks) fails the test that made it. The last test launches two fakes as subprocesses
(`engine.launch=true` with the launch command pointed at the fake) behind the real smg binary: sticky sessions
through its routing header, weight updates paused and loaded through its RL control plane.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine, SglangError
from relax_pipeline.infra.ports import free_port
from relax_pipeline.testing.sglang_server import FakeSglangServer

GREEDY = SamplingParams(8, temperature=0.0)


@asynccontextmanager
async def fakes(tiny_path: Path, n: int = 1, **options: object) -> AsyncIterator[list[FakeSglangServer]]:
    """`n` fake servers (started with SGLang's `--enable-session-radix-cache`, as the engine launches them); on exit,
    none was asked for an endpoint it does not implement."""
    servers = [FakeSglangServer(tiny_path, **({"session_radix_cache": True} | options))  # type: ignore[arg-type]
               for _ in range(n)]
    for server in servers:
        await server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop()
    for server in servers:
        assert server.state.unknown == [] or options.get("disabled"), server.state.unknown


@asynccontextmanager
async def client(tiny_path: Path, servers: list[FakeSglangServer], tmp_path: Path,
                 **options: object) -> AsyncIterator[SglangEngine]:
    settings = SglangEngineSettings(urls=[s.url for s in servers], **options)  # type: ignore[arg-type]
    engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


def test_generate_is_token_exact_with_the_embedded_engine(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path) as [server], client(tiny_path, [server], tmp_path) as engine:
            prompt = list(range(3, 30))
            got = await engine.generate(prompt, GREEDY, "r1")
            direct = await server.engine.generate(prompt, GREEDY, "direct")
            assert got.output_ids == direct.output_ids and len(got.output_ids) == 8
            assert got.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
            assert got.finish_reason == "length" and got.weight_version == 0
            seeded = SamplingParams(8, temperature=1.0, seed=7)
            assert (await engine.generate(prompt, seeded, "r2")).output_ids == \
                (await server.engine.generate(prompt, seeded, "d2")).output_ids
            assert server.state.rids == ["r1", "r2"], "our rid travels to the server"

    asyncio.run(go())


def test_abort_returns_the_partial_output_and_the_resume_continues(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, decode_delay_s=0.02) as [server], \
                client(tiny_path, [server], tmp_path) as engine:
            prompt, sampling = list(range(3, 20)), SamplingParams(400, temperature=1.0, seed=1)
            task = asyncio.create_task(engine.generate(prompt, sampling, "long"))
            await asyncio.sleep(0.6)
            partial = await engine.abort("long")
            assert partial is not None and partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 400
            assert (await task) == partial, "generate and abort return the same partial result"
            assert len(partial.logprobs) == len(partial.output_ids)
            rest = SamplingParams(3, temperature=1.0, seed=2)
            more = await engine.generate(prompt + list(partial.output_ids), rest, "long")
            assert more.finish_reason in ("length", "stop") and len(more.output_ids) <= 3
            assert await engine.abort("unknown") is None

    asyncio.run(go())


def test_a_cancelled_generate_is_aborted_on_the_server(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, decode_delay_s=0.02) as [server], \
                client(tiny_path, [server], tmp_path) as engine:
            task = asyncio.create_task(engine.generate(list(range(3, 20)), SamplingParams(400, seed=1), "gone"))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if not server.state.live:
                    break
                await asyncio.sleep(0.05)
            assert server.state.calls["POST /abort_request"] == 1 and not server.state.live

    asyncio.run(go())


def _moved_weights(tiny_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.state_dict()


def test_update_weights_loads_a_new_version_on_every_server(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, 2) as servers, client(tiny_path, servers, tmp_path) as engine:
            prompt = list(range(3, 30))
            before = await engine.generate(prompt, GREEDY, "b")
            await engine.update_weights(_moved_weights(tiny_path), 1)
            after = await engine.generate(prompt, GREEDY, "a")
            assert after.weight_version == 1 and engine.weight_version == 1
            assert after.logprobs[0] != pytest.approx(before.logprobs[0], abs=1e-4), "new weights serve"
            assert [s.state.weight_version for s in servers] == ["1", "1"]
            assert (tmp_path / "sglang" / "weights" / "v1" / "config.json").exists()
            await engine.update_weights(_moved_weights(tiny_path), 2)
            assert not (tmp_path / "sglang" / "weights" / "v1").exists(), "the previous folder is removed"
        assert not (tmp_path / "sglang" / "weights" / "v2").exists(), "and the last one at close"

    asyncio.run(go())


def test_siblings_and_a_sessions_next_turn_stay_on_one_worker(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, 2) as servers, client(tiny_path, servers, tmp_path) as engine:
            prompt = list(range(3, 60))
            first, second = await asyncio.gather(engine.generate(prompt, SamplingParams(20, seed=1), "s1"),
                                                 engine.generate(prompt, SamplingParams(20, seed=2), "s2"))
            other = await engine.generate(list(range(100, 160)), GREEDY, "other")
            observation = [7, 8, 9, 10]
            await engine.generate(prompt + list(first.output_ids) + observation, GREEDY, "s1-turn2")
            where = {rid: i for i, s in enumerate(servers) for rid in s.state.rids}
            assert where["s1"] == where["s2"] == where["s1-turn2"], where
            assert where["other"] != where["s1"], "a new prompt goes to the less loaded worker"
            assert other.output_ids and second.output_ids

    asyncio.run(go())


def test_kv_admission_waits_instead_of_overfilling_the_cache(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, capacity=200, decode_delay_s=0.01) as [server], \
                client(tiny_path, [server], tmp_path, admission="kv", kv_headroom=1.0) as engine:
            calls = [engine.generate(list(range(10 + i, 30 + i)), SamplingParams(60, seed=i), f"k{i}")
                     for i in range(4)]
            results = await asyncio.gather(*calls)
            metrics = engine.step_metrics()
            assert all(r.output_ids for r in results)
            assert server.state.peak_tokens <= 200, "never more than the KV capacity in flight"
            assert metrics["engine/admission_waits"] >= 1 and metrics["engine/admission_wait_s"] > 0
            assert 80 <= metrics["engine/kv_reserved"] <= 200
            assert engine.step_metrics()["engine/admission_waits"] == 0, "metrics are per step"

    asyncio.run(go())


def test_a_missing_endpoint_fails_naming_it(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, disabled={"/update_weights_from_disk"}) as [server], \
                client(tiny_path, [server], tmp_path) as engine:
            with pytest.raises(SglangError, match="has no endpoint /update_weights_from_disk"):
                await engine.update_weights(_moved_weights(tiny_path), 1)
            assert server.state.unknown == ["POST /update_weights_from_disk"]

    asyncio.run(go())


def test_start_fails_naming_the_url_when_no_server_answers(tiny_path: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    engine = SglangEngine(SglangEngineSettings(urls=[url]), EngineRun(str(tiny_path), output_dir=str(tmp_path)))
    with pytest.raises(SglangError, match=f"engine.urls: SGLang server {url}"):
        asyncio.run(engine.start())


@pytest.mark.parametrize(("options", "key"), [({}, "engine.urls"), ({"urls": ["http://x"], "router": "nginx"},
                                                                     "engine.router"),
                                              ({"urls": ["http://x"], "admission": "lru"}, "engine.admission")])
def test_config_errors_name_the_key(tiny_path: Path, options: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SglangEngineSettings(**options)


def test_launched_fake_servers_behind_the_real_smg(tiny_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("smg", reason="pip install -e '.[router]' (smg, the router binary)")

    async def go() -> None:
        settings = SglangEngineSettings(
            launch=True, servers=2, gpus_per_server=0, router="smg",
            launch_command=f"{sys.executable} -m relax_pipeline.testing.sglang_server",
            server_args={"decode_delay_s": 0.02, "mem_fraction_static": 0.8},
            router_command=f"{sys.executable} -m smg.launch_router", router_args={"log_level": "warn"},
            launch_timeout=120, weight_update="pause")
        engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
        await engine.start()
        pids = [p.process.pid for p in engine.processes.launched]
        try:
            assert engine._rl is not None, "smg was launched with its RL control plane"
            await _sticky_session_and_paused_update(engine, tiny_path)
            prompt = list(range(3, 40))
            results = await asyncio.gather(*(engine.generate(prompt, SamplingParams(6, seed=i), f"g{i}")
                                             for i in range(3)))
            assert all(len(r.output_ids) == 6 for r in results)
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(400, seed=9), "long"))
            await asyncio.sleep(1.0)
            partial = await engine.abort("long")
            assert partial is not None and 0 < len(partial.output_ids) < 400 and (await task) == partial
        finally:
            await engine.close()
        logs = sorted(p.name for p in (tmp_path / "sglang").glob("*.log"))
        assert logs == ["router.log", "server_0.log", "server_1.log"]
        assert "ignoring SGLang flags this fake does not model: --mem-fraction-static 0.8" in \
            (tmp_path / "sglang" / "server_0.log").read_text()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(go())


async def _sticky_session_and_paused_update(engine: SglangEngine, tiny_path: Path) -> None:
    """Three turns of one session land on one server; a paused update reaches both servers through smg's fan-out."""
    prompt = list(range(3, 30))
    for i in range(3):
        result = await engine.generate(prompt, GREEDY, f"s-t{i}", session_id="s")
        prompt = prompt + list(result.output_ids) + [40 + i]
    stats = [httpx.get(f"{url}/fake/stats").json() for url in engine._targets.urls]
    assert sorted(len([r for r in s["rids"] if r.startswith("s-t")]) for s in stats) == [0, 3], "sticky by key"
    await engine.update_weights(_moved_weights(tiny_path), 1)
    stats = [httpx.get(f"{url}/fake/stats").json() for url in engine._targets.urls]
    assert all(s["calls"].get("POST /pause_generation") == s["calls"].get("POST /continue_generation") == 1
               for s in stats) and all(s["weight_version"] == "1" for s in stats), stats
    await engine.close_session("s")


def test_engine_sglang_composes_typed_and_binds_its_class(tiny_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from relax_pipeline.config import CONF_DIR, records, register
    from relax_pipeline.recipes.parts import build

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["engine=sglang", "engine.urls=[http://127.0.0.1:30000]",
                                           "engine.admission=kv", "+engine.server_args.tp_size=2"])
        with pytest.raises(ConfigCompositionException):
            compose("config", overrides=["engine=sglang", "engine.admision=kv"])
    settings = records(cfg).engine
    assert isinstance(settings, SglangEngineSettings) and settings.server_args == {"tp_size": 2}
    engine = build(settings, EngineRun(str(tiny_path), output_dir=str(tiny_path)))
    assert isinstance(engine, SglangEngine) and engine.admission is not None
    assert engine.log_dir == tiny_path / "sglang"


def test_a_stop_string_split_by_an_abort_still_stops(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, ignore_stop=False) as [server], client(tiny_path, [server], tmp_path) as engine:
            prompt = list(range(3, 30))
            out = list((await engine.generate(prompt, SamplingParams(12, temperature=0.0), "whole")).output_ids)
            decode = engine.tokenizer.decode
            k = next(k for k in range(2, 10) if decode(out[:k]) and len(decode(out[:k + 1])) > len(decode(out[:k])))
            stop = decode(out[:k])[-1] + decode(out[:k + 1])[len(decode(out[:k]))]
            resumed = SamplingParams(8, temperature=0.0, stop=(stop,), stop_context=tuple(out[:k]))
            result = await engine.generate(prompt + out[:k], resumed, "resumed")
            assert result.output_ids == (out[k],) and result.finish_reason == "stop" and result.matched_stop == stop
            assert len(result.logprobs) == 1
            plain = await engine.generate(prompt + out[:k], SamplingParams(8, temperature=0.0, stop=(stop,)), "p")
            assert len(plain.output_ids) > 1, "without the context SGLang (the fake) does not see the split stop"

    asyncio.run(go())


def test_weight_update_pause_keeps_running_generations_going(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, decode_delay_s=0.02, ignore_stop=True) as [server], \
                client(tiny_path, [server], tmp_path, weight_update="pause") as engine:
            assert engine.in_flight_updates
            task = asyncio.create_task(engine.generate(list(range(3, 20)), SamplingParams(200, seed=1), "long"))
            await asyncio.sleep(0.3)
            await engine.update_weights(_moved_weights(tiny_path), 1)
            result = await task
            assert result.finish_reason == "length" and len(result.output_ids) == 200, "not aborted"
            versions = result.token_versions
            assert versions[0] == 0 and versions[-1] == 1 and list(versions) == sorted(versions), versions
            assert result.weight_version == 1 and len(result.weight_versions) == 200
            calls = server.state.calls
            assert calls["POST /pause_generation"] == calls["POST /continue_generation"] == 1
            assert calls["POST /abort_request"] == 0
            assert "POST /update_weights_from_disk flush_cache" in server.state.sent

    asyncio.run(go())
