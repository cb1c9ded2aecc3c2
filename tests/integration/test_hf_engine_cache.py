"""The embedded engine's prefix cache (`engine.kv_cache_mb`) on the real tiny model: what it reuses, token-exactly.

Every test runs the same requests on an engine with the cache and on one without (`kv_cache_mb=0`, every prompt
prefilled whole) and checks that the generations and their logprobs are the same, then that the cache did its work:
multi-turn sessions reuse their own history, a group's siblings prefill their shared prompt once, prefills join a
running batch with mixed hits, eviction under a small budget stays exact, a weight update empties the cache. The
model, its sharper weights and the helpers are `test_hf_engine.py`'s.
"""
# ruff: noqa: F811

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings

# `engine` and `model_path` are test_hf_engine.py's fixtures, imported so pytest finds them here and named by the
# tests' parameters (which ruff would read as redefinitions: F811).
from tests.integration.test_hf_engine import (  # noqa: F401
    GREEDY,
    engine,
    model_path,
    perturbed,
    prompt,
    reference_logprobs,
    run_all,
    wait_for_tokens,
)


@pytest_asyncio.fixture
async def uncached(model_path: Path) -> AsyncIterator[HFEngine]:
    """The same engine with the prefix cache off (`kv_cache_mb=0`): every prompt is prefilled whole."""
    eng = HFEngine(HFEngineSettings(kv_cache_mb=0), EngineRun(str(model_path), seed=7))
    await eng.start()
    yield eng
    await eng.close()


def turn_sampling(greedy: bool, session: int, turn: int) -> SamplingParams:
    if greedy:
        return SamplingParams(max_new_tokens=20, temperature=0.0)
    return SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=1000 * session + turn)


async def run_sessions(eng: HFEngine, greedy: bool, sessions: int = 4, turns: int = 4) -> list[list[GenerateResult]]:
    """Concurrent multi-turn sessions: each turn's prompt is the previous prompt + its output + an observation."""

    async def session(s: int) -> list[GenerateResult]:
        ids, results = prompt(9 + 4 * s, s), []
        for t in range(turns):
            results.append(await eng.generate(ids, turn_sampling(greedy, s, t), rid=f"s{s}-t{t}"))
            ids = ids + list(results[-1].output_ids) + prompt(5, 50 + 7 * s + t)
        return results

    return list(await asyncio.gather(*(session(s) for s in range(sessions))))


def assert_same_generations(got: Sequence[GenerateResult], want: Sequence[GenerateResult]) -> None:
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for a, b in zip(got, want, strict=True):
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.asyncio
async def test_sessions_reuse_their_kv_cache_token_exactly(engine: HFEngine, uncached: HFEngine,
                                                           greedy: bool) -> None:
    with_cache = await run_sessions(engine, greedy)
    without = await run_sessions(uncached, greedy)
    for got, want in zip(with_cache, without, strict=True):
        assert_same_generations(got, want)
    reused = sum(len(prompt(9 + 4 * s, s)) + sum(len(r.output_ids) + 5 for r in runs[:-1]) - 1
                 for s, runs in enumerate(with_cache))
    assert engine.stats["cached_tokens"] >= reused - 4 * 5
    assert uncached.stats["cached_tokens"] == 0
    assert engine.stats["prefill_tokens"] < uncached.stats["prefill_tokens"] / 3


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.asyncio
async def test_group_siblings_prefill_their_shared_prompt_once(engine: HFEngine, uncached: HFEngine,
                                                               greedy: bool) -> None:
    groups = [prompt(40, g) for g in range(3)]

    async def rollout(eng: HFEngine) -> list[GenerateResult]:
        calls = [eng.generate(p, turn_sampling(greedy, g, k), rid=f"g{g}-{k}")
                 for g, p in enumerate(groups) for k in range(8)]
        return list(await asyncio.gather(*calls))

    assert_same_generations(await rollout(engine), await rollout(uncached))
    assert engine.stats["prefill_tokens"] <= 3 * 40 + 24 < uncached.stats["prefill_tokens"] == 24 * 40
    assert engine.stats["prefill_passes"] <= 3 and uncached.stats["prefill_passes"] == 1


@pytest.mark.asyncio
async def test_prefill_joins_a_running_batch_with_mixed_cache_hits(engine: HFEngine, uncached: HFEngine) -> None:
    long_sampling = SamplingParams(max_new_tokens=60, temperature=0.0)
    await engine.generate(prompt(30, 3), GREEDY, rid="warm")

    async def mixed(eng: HFEngine) -> list[GenerateResult]:
        first = asyncio.create_task(eng.generate(prompt(5), long_sampling, rid="first"))
        await wait_for_tokens(eng, eng.stats["tokens"] + 10)
        late = [prompt(30, 3) + prompt(4, 8), prompt(2, 4), prompt(30, 3)[:12] + prompt(20, 5)]
        return [*await run_all(eng, late, GREEDY), await first]

    assert_same_generations(await mixed(engine), await mixed(uncached))
    assert engine.stats["cached_tokens"] >= 30 + 12


@pytest.mark.asyncio
async def test_generation_stays_exact_while_the_cache_evicts(engine: HFEngine, uncached: HFEngine) -> None:
    assert engine._scheduler is not None
    engine._scheduler.prefix.budget_bytes = 48 * 1024  # about 100 tokens: a session holds 100-150
    for greedy in (True, False):
        for got, want in zip(await run_sessions(engine, greedy), await run_sessions(uncached, greedy), strict=True):
            assert_same_generations(got, want)
    assert 0 < engine._scheduler.prefix.nbytes <= 48 * 1024 and engine.stats["cached_tokens"] > 0


@pytest.mark.asyncio
async def test_weight_update_clears_the_prefix_cache(engine: HFEngine) -> None:
    await engine.generate(prompt(20), GREEDY, rid="a")
    await engine.update_weights(perturbed(engine.model, 0.5), version=1)
    cached = engine.stats["cached_tokens"]
    after = await engine.generate(prompt(20), GREEDY, rid="b")
    assert engine.stats["cached_tokens"] == cached
    assert list(after.logprobs) == pytest.approx(reference_logprobs(engine.model, prompt(20), after.output_ids, 0.0),
                                                 abs=1e-4)
