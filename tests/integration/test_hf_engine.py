"""The embedded transformers engine (`engine=hf`) on the real tiny model: batching, sampling, control.

Nothing is faked: the tiny Qwen3 model and its byte-level tokenizer come from `build_tiny` (conftest's
`tiny_path`), loaded through the `Auto*` classes, and driven through `HFEngine`'s async API. The
weight matrices are redrawn with std 0.2 (seeded) because the stock init (std 0.02, tied embeddings)
makes greedy decoding repeat the last prompt token, which would make equality checks vacuous.
Logprobs are checked against an independent full forward pass of the same model. The throughput report
is marked slow and only prints (run it with `-m slow -s`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_pipeline.engine.base import Engine, GenerateResult, SamplingParams
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.sampling import StopStringMatcher
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)
FIRST_PLAIN_ID = 9
"""Ids below this are the tiny tokenizer's special tokens; prompts avoid them."""


@pytest.fixture(scope="module")
def model_path(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared tiny model (conftest) with sharper weights: varied greedy outputs, peaked logits."""
    source = tiny_path
    model = AutoModelForCausalLM.from_pretrained(source)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    target = tmp_path_factory.mktemp("tiny-sharp")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


@pytest_asyncio.fixture
async def engine(model_path: Path) -> AsyncIterator[HFEngine]:
    eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path), seed=7))
    await eng.start()
    yield eng
    await eng.close()


def prompt(length: int, offset: int = 0) -> list[int]:
    """A deterministic prompt of plain (non-special) token ids."""
    return [FIRST_PLAIN_ID + (31 * i + 17 * offset) % 500 for i in range(length)]


def reference_logprobs(
    model: torch.nn.Module, ids: Sequence[int], output: Sequence[int], temp: float
) -> list[float]:
    """log_softmax(logits / T) at each generated token, from one full forward over prompt + output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids) + list(output)])).logits[0].float()
    logprobs = torch.log_softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
    start = len(ids) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(output)]


async def run_all(
    eng: HFEngine, prompts: Sequence[list[int]], sampling: SamplingParams
) -> list[GenerateResult]:
    calls = [eng.generate(p, sampling, rid=f"r{i}") for i, p in enumerate(prompts)]
    return list(await asyncio.gather(*calls))


async def wait_for_tokens(eng: HFEngine, count: int) -> None:
    """Yield to the worker until it has sampled at least `count` tokens in total."""
    while eng.stats["tokens"] < count:
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_engine_satisfies_protocol(engine: HFEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.weight_version == 0 and engine.max_context_len == 4096
    assert engine.tokenizer.decode(engine.tokenizer.encode("hello")) == "hello"


@pytest.mark.asyncio
async def test_greedy_alone_equals_batched(engine: HFEngine) -> None:
    prompts = [prompt(3), prompt(40, 1), prompt(11, 2), prompt(1, 3), prompt(27, 4)]
    alone = [await engine.generate(p, GREEDY, rid=f"solo{i}") for i, p in enumerate(prompts)]
    together = await run_all(engine, prompts, GREEDY)
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert engine.stats["max_batch"] == len(prompts)
    for a, b in zip(alone, together, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.asyncio
async def test_rows_leaving_at_different_steps_keep_the_others_exact(engine: HFEngine) -> None:
    """Rows that finish early hand their place in the batch to rows from its end (`Batch.keep`): every row still
    decodes what it decodes alone."""
    lengths = [3, 25, 1, 9, 17, 2, 12]
    prompts = [prompt(4 + 5 * i, i) for i in range(len(lengths))]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in lengths]
    pairs = list(enumerate(zip(prompts, params, strict=True)))
    alone = [await engine.generate(p, s, rid=f"solo{i}") for i, (p, s) in pairs]
    together = await asyncio.gather(*(engine.generate(p, s, rid=f"r{i}") for i, (p, s) in pairs))
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert [len(r.output_ids) for r in together] == lengths
    for a, b in zip(alone, together, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.asyncio
async def test_requests_joining_into_rows_that_others_left_stay_exact(engine: HFEngine) -> None:
    """Short requests leave a long-running batch and new ones take their rows in the cache buffer (`Batch.add`
    without concatenation): every request decodes what it decodes alone."""
    first = [(prompt(30, i), SamplingParams(max_new_tokens=n, temperature=0.0)) for i, n in enumerate([2, 3, 40, 40])]
    later = [(prompt(6 + i, 20 + i), SamplingParams(max_new_tokens=8, temperature=0.0)) for i in range(2)]
    alone = [await engine.generate(p, s, rid=f"solo{i}") for i, (p, s) in enumerate(first + later)]
    running = [asyncio.create_task(engine.generate(p, s, rid=f"r{i}")) for i, (p, s) in enumerate(first)]
    await wait_for_tokens(engine, engine.stats["tokens"] + 12)
    joined = await asyncio.gather(*(engine.generate(p, s, rid=f"j{i}") for i, (p, s) in enumerate(later)))
    together = [*(await asyncio.gather(*running)), *joined]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]


@pytest.mark.asyncio
async def test_greedy_request_joining_a_running_batch(engine: HFEngine) -> None:
    long_sampling = SamplingParams(max_new_tokens=60, temperature=0.0)
    alone = await engine.generate(prompt(5), long_sampling, rid="alone")
    late_alone = await engine.generate(prompt(33, 9), GREEDY, rid="late-alone")
    first = asyncio.create_task(engine.generate(prompt(5), long_sampling, rid="first"))
    await wait_for_tokens(engine, engine.stats["tokens"] + 10)
    late = await engine.generate(prompt(33, 9), GREEDY, rid="late")
    assert (await first).output_ids == alone.output_ids
    assert late.output_ids == late_alone.output_ids


@pytest.mark.asyncio
async def test_seeded_sampling_is_reproducible_alone_and_batched(engine: HFEngine) -> None:
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    target = prompt(9, 5)
    first = await engine.generate(target, sampling, rid="a")
    second = await engine.generate(target, sampling, rid="b")
    others = [prompt(30, 6), prompt(2, 7)]
    batched = await run_all(engine, [*others, target], sampling)
    assert first.output_ids == second.output_ids == batched[-1].output_ids
    other_seed = await engine.generate(target, SamplingParams(max_new_tokens=20, seed=99), rid="c")
    assert other_seed.output_ids != first.output_ids


@pytest.mark.asyncio
async def test_unseeded_sampling_follows_engine_seed_and_order(model_path: Path) -> None:
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    runs = []
    for _ in range(2):
        eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path), seed=3))
        await eng.start()
        runs.append([(await eng.generate(prompt(6), sampling, rid=str(i))).output_ids for i in range(2)])
        await eng.close()
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.asyncio
async def test_logprobs_match_full_forward(engine: HFEngine, temperature: float) -> None:
    sampling = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=40, top_p=0.8, seed=5)
    prompts = [prompt(13, 8), prompt(4, 9)]
    for ids, result in zip(prompts, await run_all(engine, prompts, sampling), strict=True):
        expected = reference_logprobs(engine.model, ids, result.output_ids, temperature)
        assert list(result.logprobs) == pytest.approx(expected, abs=1e-4)
        assert all(lp <= 0.0 for lp in result.logprobs)


@pytest.mark.asyncio
async def test_eager_attention_in_bfloat16_decodes_batches_with_the_model_s_logprobs(model_path: Path) -> None:
    eng = HFEngine(HFEngineSettings(dtype="bfloat16", attn_implementation="eager"), EngineRun(str(model_path), seed=7))
    await eng.start()
    try:
        assert eng.model.config._attn_implementation == "eager" and eng.model.dtype == torch.bfloat16
        prompts = [prompt(13, 8), prompt(4, 9), prompt(7, 3)]
        results = await run_all(eng, prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5))
        for ids, result in zip(prompts, results, strict=True):
            expected = reference_logprobs(eng.model, ids, result.output_ids, 1.0)
            assert list(result.logprobs) == pytest.approx(expected, abs=0.1), "bf16: within its rounding"
    finally:
        await eng.close()
    with pytest.raises(ValueError, match="engine.attn_implementation='flash'; use one of"):
        HFEngine(HFEngineSettings(attn_implementation="flash"), EngineRun(str(model_path)))


@pytest.mark.asyncio
async def test_grouped_attention_generates_what_eager_generates(model_path: Path) -> None:
    """The tiny model has 4 query heads over 2 KV heads: `grouped` must read each KV head for both of its query
    heads, through padded prefills, a prefix-cache hit and rows joining a running batch."""
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    prompts = [prompt(13, 8), prompt(4, 9), prompt(13, 8)[:-2] + prompt(2, 2), prompt(30, 6)]
    runs = {}
    for attention in ("eager", "grouped"):
        eng = HFEngine(HFEngineSettings(attn_implementation=attention), EngineRun(str(model_path), seed=7))
        await eng.start()
        try:
            assert eng.model.config._attn_implementation == attention
            again = await eng.generate(prompts[0], sampling, "again")  # its whole prompt is in the prefix cache
            runs[attention] = [*await run_all(eng, prompts, sampling), again]
        finally:
            await eng.close()
    for eager, grouped in zip(runs["eager"], runs["grouped"], strict=True):
        assert grouped.output_ids == eager.output_ids
        assert list(grouped.logprobs) == pytest.approx(eager.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="engine.dtype='int8' is not supported"):
        HFEngine(HFEngineSettings(dtype="int8"), EngineRun(str(model_path)))


@pytest.mark.asyncio
async def test_top_k_one_is_greedy_with_untruncated_logprobs(engine: HFEngine) -> None:
    greedy = await engine.generate(prompt(10), GREEDY, rid="g")
    top1 = await engine.generate(prompt(10), SamplingParams(24, temperature=1.0, top_k=1, seed=3), rid="k")
    assert top1.output_ids == greedy.output_ids
    assert list(top1.logprobs) == pytest.approx(list(greedy.logprobs), abs=1e-6)
    assert max(top1.logprobs) < -0.01


@pytest.mark.asyncio
async def test_max_new_tokens_ends_with_length(engine: HFEngine) -> None:
    result = await engine.generate(prompt(4), SamplingParams(max_new_tokens=7, temperature=0.0), rid="x")
    assert (len(result.output_ids), result.finish_reason, result.matched_stop) == (7, "length", None)
    assert len(result.logprobs) == 7 and result.weight_versions == ()
    empty = await engine.generate(prompt(4), SamplingParams(max_new_tokens=0), rid="y")
    assert (empty.output_ids, empty.finish_reason) == ((), "length")


@pytest.mark.asyncio
async def test_context_limit(model_path: Path) -> None:
    eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path), max_context_len=32))
    await eng.start()
    try:
        result = await eng.generate(prompt(29), SamplingParams(max_new_tokens=50), rid="a")
        assert (len(result.output_ids), result.finish_reason) == (3, "length")
        with pytest.raises(ValueError, match="max_context_len=32"):
            await eng.generate(prompt(33), GREEDY, rid="b")
    finally:
        await eng.close()


@pytest.mark.asyncio
async def test_stop_token_id_is_kept(engine: HFEngine) -> None:
    free = await engine.generate(prompt(8), GREEDY, rid="free")
    stop_id = free.output_ids[5]
    cut = free.output_ids.index(stop_id) + 1
    stopped = await engine.generate(
        prompt(8), SamplingParams(24, temperature=0.0, stop_token_ids=(stop_id,)), "s"
    )
    assert stopped.output_ids == free.output_ids[:cut]
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", stop_id)


@pytest.mark.asyncio
async def test_engine_default_stop_token_ids(model_path: Path) -> None:
    eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path)))
    await eng.start()
    free = await eng.generate(prompt(8), GREEDY, rid="free")
    await eng.close()
    stop_id = free.output_ids[3]
    eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path)))
    eng.default_stop_token_ids = (stop_id,)
    await eng.start()
    stopped = await eng.generate(prompt(8), GREEDY, rid="stopped")
    await eng.close()
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop_id) + 1]
    assert stopped.matched_stop == stop_id


def first_new_text(tokenizer: object, ids: Sequence[int], start: int, width: int) -> tuple[str, int]:
    """A `width`-char suffix of the text at some token k >= start that the earlier text lacks; and k."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    for k in range(start, len(ids)):
        before, after = decode(ids[:k]), decode(ids[: k + 1])
        text = after[-width:]
        if len(after) >= width and "\ufffd" not in after and text not in before and after != before:
            return text, k
    raise AssertionError("no usable stop string in this output")


@pytest.mark.parametrize("width", [1, 6])
@pytest.mark.asyncio
async def test_stop_string(engine: HFEngine, width: int) -> None:
    free = await engine.generate(prompt(8), GREEDY, rid="free")
    text, k = first_new_text(engine.tokenizer, free.output_ids, 4, width)
    sampling = SamplingParams(24, temperature=0.0, stop=("never-there", text))
    stopped = await engine.generate(prompt(8), sampling, rid="s")
    assert stopped.output_ids == free.output_ids[: k + 1]
    assert (stopped.finish_reason, stopped.matched_stop) == ("stop", text)


@pytest.mark.asyncio
async def test_stop_string_split_by_a_resume_still_stops(engine: HFEngine) -> None:
    """A preempted generation resumes with its tokens so far appended to the prompt; a stop string that began
    before the abort and ends after it must still end the continuation (`SamplingParams.stop_context`)."""
    free = await engine.generate(prompt(8), GREEDY, rid="free")
    decode = engine.tokenizer.decode
    k = next(k for k in range(2, len(free.output_ids)) if 0 < len(decode(free.output_ids[k : k + 1]).strip()) < 4
             and "\ufffd" not in decode(free.output_ids[: k + 1]))
    text = decode(free.output_ids[: k + 1])[-6:]
    assert text not in decode(free.output_ids[:k]) and text not in decode(free.output_ids[k : k + 1])
    head = free.output_ids[:k]
    sampling = SamplingParams(24, temperature=0.0, stop=(text,), stop_context=head)
    resumed = await engine.generate(prompt(8) + list(head), sampling, rid="resumed")
    assert resumed.output_ids == free.output_ids[k : k + 1]
    assert (resumed.finish_reason, resumed.matched_stop) == ("stop", text)


def test_stop_matcher_waits_for_whole_characters(model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    ids = tokenizer.encode("zz \u00e9\u00e9\u00e9 end")
    matcher = StopStringMatcher(tokenizer, ["\u00e9\u00e9\u00e9"])
    hits = [matcher.push(i) for i in ids]
    first = next(i for i, hit in enumerate(hits) if hit)
    assert tokenizer.decode(ids[: first + 1]).endswith("\u00e9\u00e9\u00e9")
    assert hits[first] == "\u00e9\u00e9\u00e9"


@pytest.mark.asyncio
async def test_abort_returns_partial_output_to_both_callers(engine: HFEngine) -> None:
    sampling = SamplingParams(max_new_tokens=3000, temperature=1.0, seed=1)
    task = asyncio.create_task(engine.generate(prompt(10), sampling, rid="long"))
    await wait_for_tokens(engine, 5)
    aborted = await engine.abort("long")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < 3000 and len(aborted.logprobs) == len(aborted.output_ids)
    assert await task == aborted
    assert await engine.abort("long") is None
    assert await engine.abort("never-started") is None


@pytest.mark.asyncio
async def test_cancelled_generate_frees_its_slot(engine: HFEngine) -> None:
    task = asyncio.create_task(engine.generate(prompt(10), SamplingParams(3000), rid="gone"))
    await wait_for_tokens(engine, 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await engine.abort("gone") is None
    assert (await engine.generate(prompt(3), GREEDY, rid="gone")).finish_reason == "length"


def perturbed(model: torch.nn.Module, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: value + scale * torch.randn(value.shape, generator=generator)
        for name, value in model.state_dict().items()
        if value.is_floating_point()
    }


@pytest.mark.asyncio
async def test_update_weights_between_generations(engine: HFEngine) -> None:
    before = await engine.generate(prompt(6), GREEDY, rid="a")
    await engine.update_weights(perturbed(engine.model, 0.5), version=1)
    after = await engine.generate(prompt(6), GREEDY, rid="b")
    assert engine.weight_version == 1 and (before.weight_version, after.weight_version) == (0, 1)
    assert after.output_ids != before.output_ids and after.weight_versions == ()
    expected = reference_logprobs(engine.model, prompt(6), after.output_ids, 0.0)
    assert list(after.logprobs) == pytest.approx(expected, abs=1e-4)


@pytest.mark.asyncio
async def test_update_weights_mid_generation_records_versions(engine: HFEngine) -> None:
    task = asyncio.create_task(engine.generate(prompt(6), SamplingParams(3000, temperature=0.0), rid="long"))
    await wait_for_tokens(engine, 5)
    await engine.update_weights(perturbed(engine.model, 0.1), version=4)
    await wait_for_tokens(engine, engine.stats["tokens"] + 5)
    result = await engine.abort("long")
    assert result is not None and await task == result
    versions = result.weight_versions
    assert len(versions) == len(result.output_ids) and result.weight_version == 4
    switch = versions.index(4)
    assert 0 < switch and set(versions[:switch]) == {0} and set(versions[switch:]) == {4}


@pytest.mark.asyncio
async def test_update_weights_rejects_unknown_keys(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="does not have"):
        await engine.update_weights({"nope.weight": torch.zeros(1)}, version=2)
    assert engine.weight_version == 0


@pytest.mark.asyncio
async def test_concurrent_requests_share_decode_steps(engine: HFEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    sampling = SamplingParams(max_new_tokens=32, temperature=1.0)
    results = await run_all(engine, [prompt(4 + 3 * i, i) for i in range(8)], sampling)
    tick_task.cancel()
    assert all(len(r.output_ids) == 32 and r.finish_reason == "length" for r in results)
    assert engine.stats["max_batch"] == 8
    assert engine.stats["steps"] < 8 * 31
    assert ticks > 10


@pytest.mark.asyncio
async def test_requests_beyond_max_batch_size_wait_for_a_slot(model_path: Path) -> None:
    eng = HFEngine(HFEngineSettings(max_batch_size=3), EngineRun(str(model_path)))
    await eng.start()
    try:
        prompts = [prompt(2 + 5 * i, i) for i in range(8)]
        alone = [await eng.generate(p, GREEDY, rid=f"solo{i}") for i, p in enumerate(prompts)]
        together = await run_all(eng, prompts, GREEDY)
    finally:
        await eng.close()
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert eng.stats["max_batch"] == 3


@pytest.mark.asyncio
async def test_rejects_bad_requests(engine: HFEngine, model_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], GREEDY, rid="a")
    with pytest.raises(ValueError, match="top_p"):
        await engine.generate([10], SamplingParams(4, top_p=0.0), rid="b")
    with pytest.raises(ValueError, match="input_ids must lie"):
        await engine.generate([10**6], GREEDY, rid="c")
    with pytest.raises(RuntimeError, match="start"):
        await HFEngine(HFEngineSettings(), EngineRun(str(model_path))).generate([10], GREEDY, rid="d")


@pytest.mark.asyncio
async def test_close_aborts_requests_in_flight(model_path: Path) -> None:
    eng = HFEngine(HFEngineSettings(), EngineRun(str(model_path)))
    await eng.start()
    task = asyncio.create_task(eng.generate(prompt(5), SamplingParams(3000), rid="x"))
    await wait_for_tokens(eng, 3)
    await eng.close()
    assert (await task).finish_reason == "abort"
    with pytest.raises(RuntimeError, match="closed"):
        await eng.generate(prompt(5), GREEDY, rid="y")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_report_throughput(engine: HFEngine) -> None:
    """Prints generated tokens/s with 1 and with 16 concurrent requests (a report, not an assertion)."""
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0)
    await run_all(engine, [prompt(16)], sampling)
    for width in (1, 16):
        start = time.perf_counter()
        results = await run_all(engine, [prompt(16 + i, i) for i in range(width)], sampling)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output_ids) for r in results)
        print(f"\nhf engine, tiny model, {width:2d} concurrent: {tokens / seconds:8.1f} tokens/s")


@pytest.mark.asyncio
async def test_aborted_generation_resumes_from_prompt_plus_partial_tokens(engine: HFEngine) -> None:
    """Partial rollout's engine contract: abort, then prompt + partial tokens continue the same output."""
    from relax_pipeline.engine.base import joined

    sampling = SamplingParams(200, temperature=0.0)
    whole = await engine.generate(prompt(8), sampling, rid="whole")
    task = asyncio.create_task(engine.generate(prompt(8), sampling, rid="part"))
    await wait_for_tokens(engine, engine.stats["tokens"] + 5)
    partial = await engine.abort("part")
    assert partial is not None and await task == partial and 0 < len(partial.output_ids) < len(whole.output_ids)
    rest = await engine.generate(prompt(8) + list(partial.output_ids),
                                 SamplingParams(200 - len(partial.output_ids), temperature=0.0), rid="part")
    resumed = joined(partial, rest)
    assert resumed.output_ids == whole.output_ids and resumed.finish_reason == whole.finish_reason
    assert list(resumed.logprobs) == pytest.approx(list(whole.logprobs), abs=1e-4)


@pytest.mark.asyncio
async def test_threads_set_torch_intra_op_threads(model_path: Path) -> None:
    before = torch.get_num_threads()
    eng = HFEngine(HFEngineSettings(threads=1), EngineRun(str(model_path)))
    try:
        await eng.start()
        assert torch.get_num_threads() == 1
        assert (await eng.generate(prompt(4), GREEDY, rid="t")).finish_reason == "length"
    finally:
        await eng.close()
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="engine.threads"):
        HFEngine(HFEngineSettings(threads=0), EngineRun(str(model_path)))
    with pytest.raises(ValueError, match="engine.kv_cache_mb"):
        HFEngine(HFEngineSettings(kv_cache_mb=-1), EngineRun(str(model_path)))
