"""The embedded engine (`engine=hf`) on SmolLM2-135M: two workloads, each measured side by side in one run.

(a) multi-turn: `--sessions` sessions x `--turns` turns, all sessions concurrent, turns in lockstep; a turn's
prompt is the previous prompt + the `--new-tokens` generated + a short tool observation. Our engine (prefix
cache, batched prefill, continuous batching) against bare `model.generate` called per request on the very
prompts our engine saw, the same token count each (`--baseline-sessions` of them: it is sequential, so a
subset gives its rate). Printed: generated tokens/s of both and their ratio (target >= 3x), and our
turn-N/turn-1 wall-time ratio (target <= 1.5: the history is not prefilled again).
(b) GRPO-shaped: `--prompts` arith prompts ("What is a + b? Answer with just the number.", the `dataset=arith`
format, through the chat template) x `--samples` samples of `--answer-tokens` tokens, all submitted at once:
wall time with the prefix cache against `engine.kv_cache_mb=0` (prompts still prefilled in batches), each in
a fresh engine, printed as `prefix cache speed-up N.NNx` (target >= 4x); also against the engine before the
prefix cache, emulated as `kv_cache_mb=0` with every prompt prefilled alone, and whether all of them produced
the same tokens (seeded sampling).

(c) roofline (`--roofline`: batch 64, bfloat16, `grouped` attention unless given): `--batch` prompts submitted at
once decode `--roofline-tokens` tokens each (temperature 0.7, as `experiment=smollm2_arith` samples); the engine's
mean decode step (the worker's `decode_s` per step: forward, sampling, bookkeeping) against the matrix products
of that step alone (every linear layer, lm_head included, on `--batch` rows of one token, same dtype and threads,
`matmul_floor`), measured right after each of `--reps` rounds; printed as `decode step / matmul floor N.NNx`
(target <= 1.5), median of the rounds (with `--threads 1` also in CPU time: the worker thread's CPU seconds per
step against the floor's, which other processes on a shared machine do not inflate), once per `--cache-lens`
(the arith prompts, then the same left-extended by an earlier conversation to 256 tokens: attention reads the
whole cache every step, the floor does not).

(d) adapters (`--case adapters`: batch 64, bfloat16, `grouped` attention unless given; two LoRA adapters of rank
`--lora-rank` on every linear layer, engine/hf/adapters.py): the engine's mean decode step with every row on one
adapter against rows of two adapters mixed in the same batch, measured round by round side by side (`--reps`),
printed as `mixed / single adapter decode step N.NNx` (target <= 1.3: several policies in one session cost no
extra engine), and the single adapter against the base model alone (measured first, before any adapter is
loaded).

Generation never stops early (no stop tokens), so every run does the same work. The model is `model=smollm2`
(`relax_pipeline.models.smollm2`, built once into the model cache); when that cannot be built a random Llama
of SmolLM2-135M's shape with the tiny tokenizer stands in, and the output says so. Defaults take a few
minutes per case on 2 cores; shrink with --sessions/--turns/--prompts, grow with --baseline-sessions.
`--model tiny` runs both cases on the tiny test model instead (what `--smoke` does, with tiny sizes).

    python bench/engine.py [--case all|multi|grpo|roofline|adapters] [--threads N] [--batch 32] [--dtype bfloat16]
                           [--attention grouped] [--model smollm2|tiny] [--smoke]
    python bench/engine.py --roofline [--cache-lens 0,256] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _smoke import parse_args  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from relax_pipeline.engine.base import DEFAULT_ADAPTER, AdapterWeights, GenerateResult, SamplingParams  # noqa: E402
from relax_pipeline.engine.hf import batch as hf_batch  # noqa: E402
from relax_pipeline.engine.hf import engine as hf  # noqa: E402
from relax_pipeline.engine.hf.engine import HFEngine  # noqa: E402
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.models.spec import load_pretrained  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402
from relax_pipeline.train.lora import LoraSettings, adapter_state, config_dict, wrap  # noqa: E402

ARITH_PROMPT = "What is {a} + {b}? Answer with just the number."


def model_folder(model: str) -> tuple[Path, str]:
    """SmolLM2-135M-Instruct's folder, or a random stand-in of its shape (or the tiny model when `model` is
    "tiny"); and a line naming which."""
    if model == "tiny":
        return build_tiny(None, seed=0), "the tiny test model (--model tiny)"
    try:
        from relax_pipeline.models.smollm2 import build_smollm2

        return build_smollm2(), "SmolLM2-135M-Instruct (model=smollm2)"
    except Exception as error:  # noqa: BLE001 - any failure falls back to the stand-in, said out loud
        reason = f"{type(error).__name__}: {error}"
    folder = Path.home() / ".cache" / "relax_pipeline" / "bench-random-llama-135m"
    if not (folder / "config.json").exists():
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             tie_word_embeddings=True)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(build_tiny(None, seed=0)).save_pretrained(folder)
    return folder, f"random Llama of SmolLM2-135M's shape, tiny tokenizer (smollm2 unavailable: {reason})"


def encode(tokenizer: object, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


async def started(folder: Path, args: argparse.Namespace, kv_cache_mb: int) -> HFEngine:
    settings = HFEngineSettings(device=args.device, max_batch_size=args.batch, threads=args.threads,
                                kv_cache_mb=kv_cache_mb, dtype=args.dtype, attn_implementation=args.attention)
    engine = HFEngine(settings, EngineRun(str(folder), max_context_len=8192))
    await engine.start()
    await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2), rid="warm-up")
    return engine


def sampling(tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed)


# (a) multi-turn ------------------------------------------------------------------------------------------


async def ours_multi_turn(engine: HFEngine, tokenizer: object, args: argparse.Namespace
                          ) -> tuple[list[list[list[int]]], list[float], int]:
    """Run the sessions in lockstep; return each session's prompts per turn, per-turn walls, tokens made."""
    rng = random.Random(0)
    prompts = [[encode(tokenizer, [{"role": "user", "content": f"Session {s}: add up {rng.randint(10, 999)} "
                                    f"and {rng.randint(10, 999)} with the calculator tool, then explain."}])]
               for s in range(args.sessions)]
    walls, made = [], 0
    for turn in range(args.turns):
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p[-1], sampling(args.new_tokens, 100 * s + turn),
                                                         rid=f"s{s}t{turn}") for s, p in enumerate(prompts)))
        walls.append(time.perf_counter() - start)
        made += sum(len(r.output_ids) for r in results)
        if turn + 1 < args.turns:
            for s, (p, result) in enumerate(zip(prompts, results, strict=True)):
                p.append(p[-1] + list(result.output_ids) + observation(tokenizer, s, turn))
    return prompts, walls, made


def observation(tokenizer: object, session: int, turn: int) -> list[int]:
    """The end of the assistant turn, a short tool result and the next assistant header."""
    text = f"<|im_end|>\n<|im_start|>user\n<tool_response>{session * 7 + turn * 13}</tool_response><|im_end|>\n" \
           "<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


def bare_generate(model: torch.nn.Module, prompts: Sequence[list[int]], tokens: int) -> tuple[float, int]:
    """`model.generate` once per prompt, sequentially; wall seconds and tokens generated."""
    start, made = time.perf_counter(), 0
    for i, ids in enumerate(prompts):
        torch.manual_seed(i)
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        made += out.shape[1] - len(ids)
    return time.perf_counter() - start, made


async def multi_turn(folder: Path, tokenizer: object, args: argparse.Namespace) -> None:
    engine = await started(folder, args, args.kv_cache_mb)
    try:
        prompts, walls, made = await ours_multi_turn(engine, tokenizer, args)
        stats = dict(engine.stats)
    finally:
        await engine.close()
    ours_rate = made / sum(walls)
    model = load_pretrained(str(folder), torch.float32).eval()
    replay = [p for session in prompts[: args.baseline_sessions] for p in session]
    with torch.inference_mode():
        bare_s, bare_made = bare_generate(model, replay, args.new_tokens)
    bare_rate = bare_made / bare_s
    last = len(prompts[0][-1])
    print(f"multi-turn: {args.sessions} sessions x {args.turns} turns, {args.new_tokens} new tokens a turn, "
          f"prompts {len(prompts[0][0])} -> {last} tokens")
    print("  ours, wall per turn (s): " + " ".join(f"{w:.2f}" for w in walls))
    print(f"  ours: {made} tokens in {sum(walls):.1f} s = {ours_rate:.1f} tokens/s; prefilled "
          f"{stats['prefill_tokens']} tokens, {stats['cached_tokens']} from the prefix cache, "
          f"{stats['prefill_passes']} prefill passes")
    print(f"  bare model.generate per request ({len(replay)} requests of {args.baseline_sessions} sessions): "
          f"{bare_made} tokens in {bare_s:.1f} s = {bare_rate:.1f} tokens/s")
    print(f"  ours / bare generate: {ours_rate / bare_rate:.2f}x tokens/s (target >= 3)")
    print(f"  turn-{args.turns}/turn-1 wall: {walls[-1] / walls[0]:.2f} (target <= 1.5)")


# (b) GRPO-shaped -----------------------------------------------------------------------------------------


def arith_prompts(tokenizer: object, count: int) -> list[list[int]]:
    rng = random.Random(1)
    return [encode(tokenizer, [{"role": "user", "content": ARITH_PROMPT.format(a=rng.randint(0, 99),
                                                                              b=rng.randint(0, 99))}])
            for _ in range(count)]


def one_at_a_time(sizes: Sequence[int], slack: int = 64) -> list[list[int]]:
    """`hf_batch.buckets` as the engine before batched prefill behaved: every prompt is a pass of its own."""
    return [[i] for i in range(len(sizes))]


async def grpo_once(folder: Path, prompts: list[list[int]], args: argparse.Namespace, kv_cache_mb: int,
                    solo: bool = False) -> tuple[float, list[GenerateResult], dict[str, int]]:
    batched = hf_batch.buckets
    hf_batch.buckets = one_at_a_time if solo else batched
    engine = await started(folder, args, kv_cache_mb)
    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(p, sampling(args.answer_tokens, 1000 * g + k),
                                                         rid=f"g{g}-{k}")
                                         for g, p in enumerate(prompts) for k in range(args.samples)))
        return time.perf_counter() - start, list(results), dict(engine.stats)
    finally:
        await engine.close()
        hf_batch.buckets = batched


async def grpo(folder: Path, tokenizer: object, args: argparse.Namespace) -> None:
    prompts = arith_prompts(tokenizer, args.prompts)
    runs = {"one prompt at a time, no cache (the engine before)": await grpo_once(folder, prompts, args, 0, True),
            "without prefix cache (kv_cache_mb=0)": await grpo_once(folder, prompts, args, 0),
            "with prefix cache": await grpo_once(folder, prompts, args, args.kv_cache_mb)}
    print(f"GRPO-shaped: {args.prompts} prompts x {args.samples} samples, {args.answer_tokens}-token answers, "
          f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, batch {args.batch}, {args.dtype}, "
          f"attention {args.attention or 'default'}")
    for name, (seconds, _, stats) in runs.items():
        print(f"  {name}: {seconds:.1f} s; prefilled {stats['prefill_tokens']} tokens "
              f"({stats['cached_tokens']} from the cache) in {stats['prefill_passes']} passes, "
              f"{stats['steps']} decode steps")
    (solo_s, solo, _), (without_s, without, _), (with_s, cached, _) = runs.values()
    same = sum(a.output_ids == b.output_ids == c.output_ids for a, b, c in zip(cached, without, solo, strict=True))
    print(f"  same tokens in all three: {same}/{len(cached)} samples")
    print(f"  prefix cache speed-up {without_s / with_s:.2f}x (target >= 4); "
          f"over the engine before: {solo_s / with_s:.2f}x")


# (c) roofline -------------------------------------------------------------------------------------------


def matmul_floor(model: torch.nn.Module, rows: int, passes: int = 3) -> tuple[float, float]:
    """Seconds of the fastest of `passes` runs of every linear layer of `model` (lm_head included) on a batch of
    `rows` rows of one token, in the model's dtype: the matrix products of one decode step and nothing else. Wall
    seconds, and the calling thread's CPU seconds (all of the work with one torch thread)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    best, best_cpu = float("inf"), float("inf")
    with torch.inference_mode():
        for _ in range(passes):
            start, start_cpu = time.perf_counter(), time.thread_time()
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
            best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.thread_time() - start_cpu)
    return best, best_cpu


STEP_CPU = {"seconds": 0.0}
"""The engine worker's CPU seconds in decode steps (`count_step_cpu`)."""


def count_step_cpu() -> None:
    """Make every decode step of the embedded engine add its worker thread's CPU seconds to `STEP_CPU`: with one
    torch thread, the step's work whatever else runs on the machine (wall time also counts the waits for a core
    that other processes hold)."""
    step = hf._Scheduler._step

    def counted(scheduler: hf._Scheduler) -> None:
        start = time.thread_time()
        step(scheduler)
        STEP_CPU["seconds"] += time.thread_time() - start

    hf._Scheduler._step = counted  # type: ignore[method-assign]


def padded_prompts(tokenizer: object, count: int, length: int) -> list[list[int]]:
    """`count` arith prompts; with `length`, each is left-extended to `length` tokens by an earlier conversation
    (the same filler turn repeated), as a session's later turn carries its history."""
    prompts = arith_prompts(tokenizer, count)
    filler = tokenizer.encode("<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n",  # type: ignore[attr-defined]
                              add_special_tokens=False)
    return [(filler * (length // len(filler) + 1))[: max(0, length - len(p))] + p for p in prompts]


async def decode_round(engine: HFEngine, prompts: list[list[int]], tokens: int, round_: int,
                       adapters: Sequence[str | None] | None = None) -> tuple[float, float, int]:
    """All `prompts` at once, `tokens` each (prompt i with LoRA adapter `adapters[i]` when given): mean seconds of
    the engine's decode steps (model, sampling and the step's bookkeeping, `stats['decode_s']`), their mean worker
    CPU seconds (`STEP_CPU`), the largest batch."""
    before, cpu = dict(engine.stats), STEP_CPU["seconds"]
    names = adapters or [None] * len(prompts)
    await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=tokens, temperature=0.7,
                                                              seed=1000 * round_ + i), rid=f"r{round_}-{i}",
                                           adapter=names[i])
                           for i, p in enumerate(prompts)))
    steps = engine.stats["steps"] - before["steps"]
    return ((engine.stats["decode_s"] - before["decode_s"]) / steps, (STEP_CPU["seconds"] - cpu) / steps,
            int(engine.stats["max_batch"]))


async def roofline(folder: Path, tokenizer: object, args: argparse.Namespace) -> None:
    """Decode step at batch `--batch` against the matmul floor, side by side per round, for each `--cache-lens`;
    in wall time, and with one torch thread also in CPU time (the steps' own work on a shared machine)."""
    count_step_cpu()
    engine = await started(folder, args, 0)
    try:
        for length in args.cache_lens:
            prompts = padded_prompts(tokenizer, args.batch, length)
            ratios, cpu_ratios, steps, floors = [], [], [], []
            for round_ in range(args.reps):
                step, step_cpu, batch = await decode_round(engine, prompts, args.roofline_tokens, round_)
                floor, floor_cpu = matmul_floor(engine.model, args.batch)
                steps.append(step), floors.append(floor), ratios.append(step / floor)
                cpu_ratios.append(step_cpu / floor_cpu)
            columns = f"{min(map(len, prompts))}-{max(map(len, prompts)) + args.roofline_tokens}"
            print(f"roofline: batch {batch}, {args.dtype}, attention {args.attention or 'default'}, cache {columns} "
                  f"columns, {args.reps} rounds of {args.roofline_tokens} steps; decode step {median(steps) * 1e3:.1f} "
                  f"ms, matmul floor {median(floors) * 1e3:.1f} ms (per round: "
                  + " ".join(f"{r:.2f}" for r in ratios) + ")")
            print(f"  decode step / matmul floor {median(ratios):.2f}x (target <= 1.5)")
            if torch.get_num_threads() == 1:
                print(f"  in CPU time (one thread: the work itself, not the waits for a core): "
                      f"{median(cpu_ratios):.2f}x (per round: " + " ".join(f"{r:.2f}" for r in cpu_ratios) + ")")
    finally:
        await engine.close()


# (d) adapters ---------------------------------------------------------------------------------------------

def drawn_adapter(folder: Path, name: str, seed: int, rank: int, dtype: str) -> AdapterWeights:
    """A LoRA adapter of rank `rank` on every linear layer (PEFT's all-linear, as `experiment=smollm2_arith_lora`),
    its B drawn small instead of PEFT's zeros, so it changes what the model samples."""
    torch.manual_seed(seed)
    model = wrap(load_pretrained(folder, getattr(torch, dtype)), LoraSettings(rank=rank, base_dtype=dtype))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if ".lora_B" in param_name:
                param.normal_(0.0, 0.01)
    return AdapterWeights(name, config_dict(model), adapter_state(model))


async def adapters(folder: Path, tokenizer: object, args: argparse.Namespace) -> None:
    """Decode steps at batch `--batch`, side by side per round: every row with one adapter against rows of two
    adapters (alternating, PEFT's mixed batch: each adapter's product on its own rows), and before either is loaded
    the base model alone (the written-out step's fused products, engine/hf/decode_step.py)."""
    engine = await started(folder, args, 0)
    try:
        prompts = padded_prompts(tokenizer, args.batch, 0)
        base = [(await decode_round(engine, prompts, args.roofline_tokens, r))[0] for r in range(args.reps)]
        for seed, name in enumerate((DEFAULT_ADAPTER, "second")):
            await engine.update_adapter(drawn_adapter(folder, name, seed, args.lora_rank, args.dtype), 1)
        one, two = [DEFAULT_ADAPTER] * len(prompts), [(DEFAULT_ADAPTER, "second")[i % 2] for i in range(len(prompts))]
        single, mixed = [], []
        for r in range(args.reps):
            single.append((await decode_round(engine, prompts, args.roofline_tokens, r, one))[0])
            mixed.append((await decode_round(engine, prompts, args.roofline_tokens, r, two))[0])
        print(f"adapters: batch {len(prompts)}, {args.dtype}, attention {args.attention or 'default'}, rank "
              f"{args.lora_rank} on every linear layer, {args.reps} rounds of {args.roofline_tokens} steps; decode "
              f"step base {median(base) * 1e3:.1f} ms, one adapter {median(single) * 1e3:.1f} ms, two adapters mixed "
              f"{median(mixed) * 1e3:.1f} ms (per round mixed/one: "
              + " ".join(f"{m / s:.2f}" for m, s in zip(mixed, single, strict=True)) + ")")
        print(f"  mixed / single adapter decode step {median(mixed) / median(single):.2f}x (target <= 1.3); "
              f"single adapter / base {median(single) / median(base):.2f}x")
    finally:
        await engine.close()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("all", "multi", "grpo", "roofline", "adapters"), default="all")
    parser.add_argument("--roofline", action="store_const", const="roofline", dest="case",
                        help="only the roofline case: a decode step at --batch against its matmul floor")
    parser.add_argument("--threads", type=int, default=None, help="engine.threads (default: torch's)")
    parser.add_argument("--batch", type=int, default=32, help="engine.max_batch_size")
    parser.add_argument("--dtype", default="float32", help="engine.dtype (smollm2_arith: bfloat16)")
    parser.add_argument("--attention", default=None, help="engine.attn_implementation (smollm2_arith: grouped)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--baseline-sessions", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--cache-lens", type=lambda text: [int(n) for n in text.split(",")], default=[0, 256],
                        help="roofline: prompt lengths, comma-separated (0: the arith prompts as they are)")
    parser.add_argument("--roofline-tokens", type=int, default=32, help="roofline: decode steps a round")
    parser.add_argument("--reps", type=int, default=5, help="roofline: rounds, each beside its own floor")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--device", default="cpu", help="engine.device, e.g. cuda")
    parser.add_argument("--lora-rank", type=int, default=16, help="adapters: the adapters' rank")
    if parser.parse_known_args()[0].case in ("roofline", "adapters"):
        parser.set_defaults(batch=64, dtype="bfloat16", attention="grouped")
    return parse_args(parser, model="tiny", batch=4, kv_cache_mb=64, sessions=2, turns=2, new_tokens=4,
                      baseline_sessions=1, prompts=2, samples=2, answer_tokens=4, cache_lens="0,32",
                      roofline_tokens=4, reps=2)


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder, name = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    print(f"model: {name}; torch threads {torch.get_num_threads()}")
    if args.case in ("all", "multi"):
        asyncio.run(multi_turn(folder, tokenizer, args))
    if args.case in ("all", "grpo"):
        asyncio.run(grpo(folder, tokenizer, args))
    if args.case in ("all", "roofline"):
        asyncio.run(roofline(folder, tokenizer, args))
    if args.case in ("all", "adapters"):
        asyncio.run(adapters(folder, tokenizer, args))


if __name__ == "__main__":
    main()
