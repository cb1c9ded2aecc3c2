"""`engine=sglang` overhead per turn, side by side in one run: agents through our gateway and SGLang client vs the
same generations sent straight to the servers.

Set-up (CPU here; on a GPU machine pass `--launch-command 'python -m sglang.launch_server' --model PATH`):
`SglangEngine` launches `--servers` servers (by default the SGLang-wire fake, `relax_pipeline.testing.sglang_server`,
on the tiny model, with `--ignore-stop` so every generation is exactly `--tokens` tokens, and its prefix cache
off so a replayed prompt costs what it cost the first time) behind the real
smg, and our gateway serves them in this process as a run does (`create_app` + `TurnService`).

Three ways to make the same generations, run back to back in each of `--repeats` rounds:

- ours: `--sessions` concurrent agents, each `--turns` chat-completion turns with its growing history, through
  the gateway (parse, match, tokenize, commit) and the client (affinity key, `/generate` via the router);
- router: the very prompts ours sent (recorded token ids, same sampling, same routing keys, so the router
  sends each session to the worker it chose for ours), posted to the router's `/generate` by the same number
  of concurrent senders, each replaying one session's turns in order;
- server: the same, posted straight to the servers, each session to the server that served it in ours (the
  fake reports its rids; other servers: alternating), so both meet the same balance.

The replays follow ours in each round (their order alternates between rounds), so they meet the servers'
prefix caches as warm as ours left them; on a machine shared with other work, run more rounds.

Printed: mean ms per turn of each (median over rounds after a warm-up round), and the median of the per-round
ratios ours/server (gateway + client + router overhead; target ≤ 1.3×) and ours/router (gateway + client only),
with their range: per-turn model time dominates and a shared 2-core machine is noisy, so pairs measured
seconds apart within a round are compared, never whole runs.

Then, on the same servers, two clients side by side (`engine.sessions` and `engine.weight_update`):

- sessions off vs on: one `--session-turns`-turn session (each turn `--tokens` tokens, then a 10-token
  observation, each client its own prompts); printed: the prompt tokens the servers prefill per turn (off: the
  whole prompt as the client sends it, not what a radix cache would serve of it; on: the prompt less
  `meta_info.cached_tokens`, what the session kept) and the new tokens per turn, which the on figure must not
  exceed. The fake's model time does not model the kept KV, so no times here.
- abort vs pause: `--update-generations` generations of `--update-tokens` tokens, a weight update once they
  run; abort aborts them, updates and resumes each with its partial tokens appended (as the turn service does),
  pause updates in place. Printed: seconds until all finished and the tokens re-prefilled by resumes.

    python bench/engine_sglang.py [--sessions 8] [--turns 6] [--tokens 8] [--servers 2] [--repeats 3]
                                  [--session-turns 8] [--update-generations 4] [--update-tokens 96] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from _smoke import parse_args  # noqa: E402

from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings

PREFIX = "/agentic_api"


class Recorder:
    """Wraps the engine's generate to record each call's prompt ids, sampling, rid and routing key."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], Any]] = []
        self.rids: list[str] = []
        self.generate_s: list[float] = []
        """Seconds each `engine.generate` took (client + router + server, inside ours)."""
        self.keys: dict[str, str] = {}
        """rid → the routing key the client sent it with."""
        self._generate, self._call = engine.generate, engine._generate_call
        engine.generate, engine._generate_call = self.generate, self.generate_call

    async def generate(self, input_ids: Any, sampling: Any, rid: str, media: Any = None,
                       session_id: str | None = None) -> Any:
        self.calls.append((list(input_ids), sampling))
        self.rids.append(rid)
        started = time.perf_counter()
        try:
            return await self._generate(input_ids, sampling, rid, media, session_id=session_id)
        finally:
            self.generate_s.append(time.perf_counter() - started)

    async def generate_call(self, worker: Any, key: str, payload: dict[str, Any]) -> Any:
        self.keys[payload["rid"]] = key
        return await self._call(worker, key, payload)


async def agent_session(http: httpx.AsyncClient, base: str, session_id: str, turns: int, tokens: int) -> list[float]:
    """One agent: `turns` chat completions replaying the growing history; seconds per turn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task for {session_id}: add 2 and 3."}]
    took = []
    for turn in range(turns):
        started = time.perf_counter()
        answer = await http.post(base + "v1/chat/completions", headers={"Authorization": f"Bearer {session_id}"},
                                 json={"model": "policy", "messages": messages, "max_tokens": tokens})
        took.append(time.perf_counter() - started)
        answer.raise_for_status()
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": f"Tool result {turn}."}]
    return took


async def replay(http: httpx.AsyncClient, url: str, calls: list[tuple[list[int], Any]], tag: str,
                 key: str) -> list[float]:
    """The recorded generations of one session, in order, straight to `url`/generate (routing key `key`, which
    a router keeps on the worker it chose for ours); seconds per turn."""
    from relax_pipeline.engine.sglang.wire import payload

    took = []
    for i, (ids, sampling) in enumerate(calls):
        started = time.perf_counter()
        answer = await http.post(url + "/generate", json=payload(ids, sampling, sampling.max_new_tokens, f"{tag}-{i}"),
                                 headers={"x-smg-routing-key": key})
        took.append(time.perf_counter() - started)
        answer.raise_for_status()
    return took


async def measure(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, float]]:
    from relax_pipeline.chat.parsers import OutputParser
    from relax_pipeline.chat.template import ChatTemplate
    from relax_pipeline.engine.sglang.client import SglangEngine
    from relax_pipeline.gateway.app import create_app
    from relax_pipeline.gateway.server import GatewayServer
    from relax_pipeline.models.tiny import build_tiny
    from relax_pipeline.turn.service import SamplingDefaults, TurnService
    from relax_pipeline.turn.sessions import ForestStore

    model = args.model or str(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    fake = f"{sys.executable} -m relax_pipeline.testing.sglang_server"
    settings = SglangEngineSettings(
        launch=True, servers=args.servers, gpus_per_server=args.gpus_per_server,
        launch_command=args.launch_command or fake,
        server_args={} if args.launch_command else {"ignore_stop": True, "kv_cache_mb": 0}, router="smg",
        router_command=f"{sys.executable} -m smg.launch_router", router_args={"log_level": "warn"})
    engine = SglangEngine(settings, EngineRun(model, output_dir=tempfile.mkdtemp(prefix="bench-sglang-")))
    await engine.start()
    recorder = Recorder(engine)
    turns = TurnService(ChatTemplate(engine.tokenizer), engine, OutputParser(),
                        SamplingDefaults(max_context_len=4096, max_response_len=args.tokens, temperature=1.0))
    store = ForestStore()
    server = GatewayServer(create_app(store, turns, prefix=PREFIX), prefix=PREFIX)
    await server.start()
    results: dict[str, list[float]] = {"ours": [], "ours_generate": [], "router": [], "server": []}
    try:
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
            for round_ in range(args.repeats + 1):  # round 0 warms up (first connections, caches) and is dropped
                per_session = await _ours(http, server.base_url, store, recorder, round_, args, results)
                kinds = ["router", "server"] if round_ % 2 == 0 else ["server", "router"]
                for kind in kinds:  # alternate the order, so drift on a shared machine hits both alike
                    urls = [engine._targets.router or ""] * len(per_session) if kind == "router" else \
                        await _servers_of(http, engine._targets.urls, recorder, per_session)
                    rid_of = {id(ids): rid for (ids, _), rid in zip(recorder.calls, recorder.rids, strict=True)}
                    keys = [recorder.keys[rid_of[id(calls[0][0])]] for calls in per_session]
                    took = await asyncio.gather(*(replay(http, urls[i], calls, f"{kind}{round_}-{i}", keys[i])
                                                  for i, calls in enumerate(per_session)))
                    results[kind].append(statistics.mean(t for session in took for t in session))
        figures = await side_by_side(engine._targets.urls, model, args)
    finally:
        await server.stop()
        await engine.close()
    return {kind: values[1:] for kind, values in results.items()}, figures


async def side_by_side(urls: list[str], model: str, args: argparse.Namespace) -> dict[str, float]:
    """Sessions off vs on and weight updates by abort vs pause, two clients of the same servers."""
    from relax_pipeline.engine.sglang.client import SglangEngine

    clients = []
    for options in ({"sessions": False, "weight_update": "abort"}, {"sessions": True, "weight_update": "pause"}):
        client = SglangEngine(SglangEngineSettings(urls=urls, **options), EngineRun(model))
        await client.start()
        clients.append(client)
    try:
        off, on = [await session_prefill(c, args.session_turns, args.tokens, first=3 + 100 * i)
                   for i, c in enumerate(clients)]
        weights = await asyncio.to_thread(_weights, model)
        aborted = await updated_by_abort(clients[0], weights, args)
        paused = await updated_by_pause(clients[1], weights, args)
    finally:
        for client in clients:
            await client.close()
    return {"prefill_off": off[0], "prefill_on": on[0], "new_tokens": on[1], "abort_s": aborted[0],
            "abort_reprefill": aborted[1], "pause_s": paused[0], "pause_reprefill": paused[1]}


async def session_prefill(client: Any, turns: int, tokens: int, first: int = 3) -> tuple[float, float]:
    """One session of `turns` turns from prompt `first..first+39` (each client its own, so neither is served from
    the other's cache); the mean prompt tokens prefilled per turn and the mean new tokens per turn."""
    from relax_pipeline.engine.base import SamplingParams

    prompt, prompts, new = list(range(first, first + 40)), [], []
    client.step_metrics()
    for turn in range(turns):
        result = await client.generate(prompt, SamplingParams(tokens, seed=turn), f"sess-{turn}", session_id="bench")
        prompts.append(len(prompt))
        new.append(len(prompt) - (prompts[-2] + tokens if turn else 0))
        prompt = prompt + list(result.output_ids) + list(range(50, 60))
    cached = client.step_metrics().get("engine/session_cached_tokens", 0.0)
    await client.close_session("bench")
    return statistics.mean(prompts) - cached, statistics.mean(new)


async def updated_by_abort(client: Any, weights: dict[str, Any], args: argparse.Namespace) -> tuple[float, int]:
    """Generations aborted for a weight update and resumed after it; seconds and re-prefilled tokens."""
    from relax_pipeline.engine.base import SamplingParams, joined, resume_input

    updated, reprefilled = asyncio.Event(), [0]

    async def one(i: int) -> None:
        prompt, sampling, done = list(range(3 + i, 40 + i)), SamplingParams(args.update_tokens, seed=i), None
        while True:
            ids, rest = resume_input(prompt, sampling, done)
            more = await client.generate(ids, rest, f"abort-{i}")
            done = joined(done, more)
            if more.finish_reason != "abort":
                return
            reprefilled[0] += len(prompt) + len(done.output_ids)
            await updated.wait()

    started = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(args.update_generations)]
    await asyncio.sleep(0.2)
    await asyncio.gather(*(client.abort(f"abort-{i}") for i in range(args.update_generations)))
    await client.update_weights(weights, 1)
    updated.set()
    await asyncio.gather(*tasks)
    return time.perf_counter() - started, reprefilled[0]


async def updated_by_pause(client: Any, weights: dict[str, Any], args: argparse.Namespace) -> tuple[float, int]:
    """The same generations through a weight update paused in place; seconds and re-prefilled tokens (none)."""
    from relax_pipeline.engine.base import SamplingParams

    started = time.perf_counter()
    tasks = [asyncio.create_task(client.generate(list(range(3 + i, 40 + i)), SamplingParams(args.update_tokens, seed=i),
                                                 f"pause-{i}")) for i in range(args.update_generations)]
    await asyncio.sleep(0.2)
    await client.update_weights(weights, 2)
    results = await asyncio.gather(*tasks)
    assert all(r.finish_reason != "abort" for r in results)
    return time.perf_counter() - started, 0


def _weights(model: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model).state_dict()


async def _servers_of(http: httpx.AsyncClient, urls: list[str], recorder: Recorder,
                      per_session: list[list[tuple[list[int], Any]]]) -> list[str]:
    """The server that served each session in ours (the fake reports its rids), so the direct replay meets
    the same balance the router made; alternating servers when the servers are not the fake."""
    served: dict[str, str] = {}
    for url in urls:
        answer = await http.get(url + "/fake/stats")
        served.update({rid: url for rid in answer.json().get("rids", [])} if answer.is_success else {})
    rid_of = {id(ids): rid for (ids, _), rid in zip(recorder.calls, recorder.rids, strict=True)}
    return [served.get(rid_of.get(id(calls[0][0]), ""), urls[i % len(urls)]) for i, calls in enumerate(per_session)]


async def _ours(http: httpx.AsyncClient, base: str, store: Any, recorder: Recorder, round_: int,
                args: argparse.Namespace, results: dict[str, list[float]]) -> list[list[tuple[list[int], Any]]]:
    """One round of agents through the gateway; the generations it made, by session."""
    from relax_pipeline.turn.sessions import Status

    sessions = []
    for i in range(args.sessions):
        session = store.open(f"g{round_}-{i}", 0, 0, "train", {})
        store.set_status(session, Status.RUNNING)
        sessions.append(session.key)
    recorder.calls.clear()
    recorder.rids.clear()
    recorder.generate_s.clear()
    took = await asyncio.gather(*(agent_session(http, base, s, args.turns, args.tokens) for s in sessions))
    results["ours"].append(statistics.mean(t for session in took for t in session))
    results["ours_generate"].append(statistics.mean(recorder.generate_s))
    return _by_session(recorder.calls, args.sessions, args.turns)


def _by_session(calls: list[tuple[list[int], Any]], sessions: int, turns: int) -> list[list[tuple[list[int], Any]]]:
    """Group the recorded calls by session: a call continues the session whose last prompt it extends."""
    chains: list[list[tuple[list[int], Any]]] = []
    for ids, sampling in calls:
        for chain in chains:
            last = chain[-1][0]
            if len(ids) > len(last) and ids[: len(last)] == last:
                chain.append((ids, sampling))
                break
        else:
            chains.append([(ids, sampling)])
    assert len(chains) == sessions and all(len(c) == turns for c in chains), [len(c) for c in chains]
    return chains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--gpus-per-server", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder (default: the tiny model)")
    parser.add_argument("--launch-command", default=None, help="default: the SGLang-wire fake")
    parser.add_argument("--session-turns", type=int, default=8)
    parser.add_argument("--update-generations", type=int, default=4)
    parser.add_argument("--update-tokens", type=int, default=96)
    args = parse_args(parser, sessions=2, turns=2, tokens=2, servers=1, repeats=1, session_turns=3,
                      update_generations=2, update_tokens=16)
    results, figures = asyncio.run(measure(args))
    ms = {k: statistics.median(v) * 1000 for k, v in results.items()}
    print(f"{args.sessions} sessions x {args.turns} turns, {args.tokens} tokens a turn, {args.servers} servers "
          f"behind smg, {args.repeats} rounds after a warm-up (median of per-round means)")
    for kind, value in ms.items():
        print(f"  {kind:13s} {value:8.2f} ms per turn")
    for base, what in (("server", "gateway + client + router; target <= 1.3x"), ("router", "gateway + client")):
        ratios = sorted(o / b for o, b in zip(results["ours"], results[base], strict=True))
        print(f"ratio ours/{base} {statistics.median(ratios):.3f}x (median of per-round ratios, range "
              f"{ratios[0]:.2f}-{ratios[-1]:.2f}; {what})")
    f = figures
    print(f"session of {args.session_turns} turns: prefill tokens per turn, sessions off {f['prefill_off']:.1f}, "
          f"on {f['prefill_on']:.1f} (new tokens per turn {f['new_tokens']:.1f})")
    print(f"weight update amid {args.update_generations} generations of {args.update_tokens} tokens: abort+resume "
          f"{f['abort_s']:.2f} s, {f['abort_reprefill']:.0f} tokens re-prefilled; pause {f['pause_s']:.2f} s, "
          f"{f['pause_reprefill']:.0f} re-prefilled; abort/pause {f['abort_s'] / f['pause_s']:.2f}x")

if __name__ == "__main__":
    main()
