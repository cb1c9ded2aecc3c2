"""Program-aware admission against none and against per-request admission, side by side in one run, on a long-tail
multi-turn workload that does not fit the KV pool at once.

Set-up: the SGLang-wire fake (`relax_pipeline.testing.sglang_server`, in this process) on the tiny model, with
`ignore_stop` (every turn generates exactly `--tokens` tokens) and a KV pool of `--kv-tokens` tokens
(`testing/kv_pool.py`, SGLang 0.5.23's radix cache as counts: running requests hold prompt + max_new_tokens, idle KV
is evicted least recently used, an open session's KV last (the fake runs with `--enable-session-radix-cache`), a
closed session's KV is dereferenced and stays cached until evicted, a turn whose KV was evicted is re-prefilled and
counted). Prefill costs `--prefill-ms-per-1k` ms per thousand
prefilled tokens (the fake's model is tiny, so this stands for a real model's prefill; the value is printed).

Workload (one step): `--sessions` agent sessions over `--tasks` tasks (sessions of a task share its first prompt
of `--prompt-tokens` tokens, like a GRPO group); each turn generates `--tokens` tokens, then the agent "runs a
tool" for `--tool-ms` ms (its KV sits idle) and adds a `--obs-tokens`-token observation. Long tail: the sessions
of the first `--long-tasks` tasks run `--long-turns` turns, the others `--turns`. Each session is one
`engine.sessions` SGLang session, closed when it ends (as the turn service does).

Three clients, one fresh fake each, the same `--steps` steps (the same workload each step, so program admission
learns each task's growth in the first and uses it after; the clients take turns step by step, so a busy moment
of a shared machine hits them alike): `engine.admission=none`, `kv` (per request:
prompt + max_new_tokens reserved against max_total_num_tokens) and `program` (per session: context + the growth
learned per task, `--growth-prior` before any session finished). Printed per client and step: sessions
re-prefilled because their KV was evicted (of all sessions), tokens re-prefilled, evictions, the step's wall time,
seconds sessions waited for admission (summed); then, over the steps after the first (the median), the
sessions re-prefilled and the step time of kv and program against none.

    python bench/admission.py [--sessions 24] [--tasks 6] [--long-tasks 1] [--turns 3] [--long-turns 12]
                              [--kv-tokens 1600] [--steps 4] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _smoke import parse_args  # noqa: E402

from relax_pipeline.engine.base import SamplingParams  # noqa: E402
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings  # noqa: E402
from relax_pipeline.engine.sglang.client import SglangEngine  # noqa: E402
from relax_pipeline.testing.sglang_server import FakeSglangServer  # noqa: E402

MODES = ("none", "kv", "program")


@dataclass(frozen=True)
class StepFigures:
    """One client's step: what the fake's pool counted and what the step took."""

    reprefilled_sessions: int
    reprefill_tokens: int
    evictions: int
    step_s: float
    wait_s: float


def task_prompt(task: int, args: argparse.Namespace) -> list[int]:
    """Task `task`'s first prompt: distinct from the first token on (ids the tiny model's vocabulary holds)."""
    return [10 + task] + [(task * 7 + i) % 200 + 20 for i in range(args.prompt_tokens - 1)]


async def session(engine: SglangEngine, step: int, index: int, args: argparse.Namespace) -> None:
    """One agent session: its turns with tool time and observations between, then closed."""
    task = index % args.tasks
    turns = args.long_turns if task < args.long_tasks else args.turns
    session_id, prompt = f"s{step}-{index}", task_prompt(task, args)
    sampling = SamplingParams(args.tokens, temperature=1.0, seed=index)
    for turn in range(turns):
        result = await engine.generate(prompt, sampling, f"{session_id}-t{turn}", session_id=session_id)
        await asyncio.sleep(args.tool_ms / 1000)
        prompt = prompt + list(result.output_ids) + [(index + turn + i) % 200 + 20 for i in range(args.obs_tokens)]
    await engine.close_session(session_id)


async def one_step(engine: SglangEngine, server: FakeSglangServer, step: int,
                   args: argparse.Namespace) -> StepFigures:
    before = server.state.pool.stats()
    started = time.perf_counter()
    await asyncio.gather(*(session(engine, step, i, args) for i in range(args.sessions)))
    step_s = time.perf_counter() - started
    after, metrics = server.state.pool.stats(), engine.step_metrics()
    reprefilled = {s for s in server.state.pool.reprefilled if s.startswith(f"s{step}-")}
    return StepFigures(len(reprefilled), after["kv_reprefill_tokens"] - before["kv_reprefill_tokens"],
                       after["kv_evictions"] - before["kv_evictions"], step_s,
                       metrics.get("agentic_kv/wait_s", metrics.get("engine/admission_wait_s", 0.0)))


async def client(mode: str, model: str, args: argparse.Namespace, stack: AsyncExitStack
                 ) -> tuple[SglangEngine, FakeSglangServer]:
    """A fresh fake and a client with `engine.admission=mode` in front of it (closed with `stack`)."""
    server = await stack.enter_async_context(FakeSglangServer(model, capacity=args.kv_tokens, ignore_stop=True,
                                                              kv_cache_mb=16, max_context_len=4096,
                                                              session_radix_cache=True))
    server.state.pool.prefill_s_per_1k = args.prefill_ms_per_1k / 1000
    settings = SglangEngineSettings(urls=[server.url], admission=mode, kv_headroom=1.0,
                                    admission_growth_prior=args.growth_prior)
    engine = SglangEngine(settings, EngineRun(model, output_dir=tempfile.mkdtemp(prefix="bench-admission-")))
    await engine.start()
    stack.push_async_callback(engine.close)
    await engine.generate([5] * 16, SamplingParams(args.tokens), "warm-up")  # no session, no task prompt
    return engine, server


def report(results: dict[str, list[StepFigures]], args: argparse.Namespace) -> None:
    print(f"{args.sessions} sessions over {args.tasks} tasks ({args.long_tasks} long: {args.long_turns} turns, "
          f"others {args.turns}), {args.tokens} tokens a turn + {args.obs_tokens}-token observations, "
          f"KV pool {args.kv_tokens} tokens, prefill {args.prefill_ms_per_1k} ms per 1k tokens")
    print(f"{'admission':<10} {'step':>4} {'re-prefilled sessions':>22} {'re-prefill tokens':>18} "
          f"{'evictions':>10} {'step s':>8} {'wait s (sum)':>13}")
    for mode, steps in results.items():
        for step, f in enumerate(steps):
            print(f"{mode:<10} {step:>4} {f'{f.reprefilled_sessions}/{args.sessions}':>22} {f.reprefill_tokens:>18} "
                  f"{f.evictions:>10} {f.step_s:>8.2f} {f.wait_s:>13.2f}")
    later = {mode: steps[1:] or steps for mode, steps in results.items()}  # step 0: program admission learns
    base_s = statistics.median(f.step_s for f in later["none"])
    base_sessions = statistics.median(f.reprefilled_sessions for f in later["none"])
    for mode in ("kv", "program"):
        sessions = statistics.median(f.reprefilled_sessions for f in later[mode])
        step_s = statistics.median(f.step_s for f in later[mode])
        print(f"steps 1+ (median), {mode} / none: re-prefilled sessions {sessions:g}/{base_sessions:g}, "
              f"step time {step_s / base_s:.2f}x")


async def main(args: argparse.Namespace) -> None:
    from relax_pipeline.models.tiny import build_tiny

    model = args.model or str(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    results: dict[str, list[StepFigures]] = {mode: [] for mode in MODES}
    async with AsyncExitStack() as stack:
        clients = {mode: await client(mode, model, args, stack) for mode in MODES}
        for step in range(args.steps):  # modes take turns, so a busy moment of the machine hits them alike
            for mode, (engine, server) in clients.items():
                results[mode].append(await one_step(engine, server, step, args))
    report(results, args)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--long-tasks", type=int, default=1)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--long-turns", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated each turn")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--obs-tokens", type=int, default=24)
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--kv-tokens", type=int, default=1600, help="the fake's max_total_num_tokens")
    parser.add_argument("--prefill-ms-per-1k", type=float, default=20.0)
    parser.add_argument("--growth-prior", type=int, default=128, help="engine.admission_growth_prior")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    return parse_args(parser, sessions=6, tasks=3, turns=2, long_turns=4, kv_tokens=500, tool_ms=10.0, steps=2)


if __name__ == "__main__":
    asyncio.run(main(arguments()))
