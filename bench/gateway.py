"""Gateway cost over real HTTP, side by side in one run: a bare FastAPI echo vs our gateway as a run starts it.

Each server runs in its own process (`bench/_gateway_server.py`); this process is only the load generator, so its
CPU is never counted as the server's (each server reports its own CPU time from `getrusage` on SIGUSR2: all its
threads, microsecond resolution, where /proc/<pid>/stat counts 10 ms ticks). The two servers:

- bare: a FastAPI endpoint that reads and parses the body and returns a fixed chat completion, under
  uvicorn binding its own socket (the floor any Python HTTP gateway pays);
- ours: `create_app` over a `ForestStore` and a `TurnService` with an engine that answers instantly
  (`ScriptedEngine`), served by `GatewayServer.start()` in an `asyncio.run` loop, exactly as a run
  serves it: its socket options are the ones agents see, it writes its access line per request to a
  run.log (`run_logging`; the report counts the lines), and the garbage collector is settled as the
  step loop does before a step (`settle_garbage`).

Tracing (`tracking.traces`, tracking/traces.py): a third server, `traced`, is ours with session traces on. The
turn service stamps a turn's times either way (a few clock reads per engine call); what tracing adds is the work
at the end of a step: each session's spans built from those stamps, made OpenTelemetry spans and written as OTLP
JSON. The traced server does that for every session of a phase before it reports its CPU at the phase's end (so
the phase's CPU includes it, in its background thread too), and the report prints ours' CPU per request with
tracing on vs off, side by side in the same repeats.

Every client records sessions of `--turns` turns (default 32) on one keep-alive connection, replaying
the whole growing history each turn. Phase one runs `--serial` sessions one after another (concurrency
1), phase two `--clients` clients at once (default 32), each client `--rounds` sessions. Both servers
stay up and each repeat runs every phase on bare then on ours, back to back, so load from elsewhere on
the machine hits both alike. Printed per server and phase: requests/s and server CPU ms per request
(medians of the repeats), p50 and p99 latency (all requests); the ratio ours/bare of CPU per request
(issue 33: ≤ 1.5× at 1 and at 32 clients), requests/s at 32 clients (≥ 500); our gateway's memory per stored
token: its RSS growth over the phases divided by the tokens its sessions' forests gained (RSS read
after `gc.collect()`, so it counts what the forests keep, not garbage); and the CPU time its garbage
collector spent during the phases per generation, with the longest full collection (what a p99 pays
for; measured as thread CPU time, so other load on the machine does not inflate it the way it does
wall-clock percentiles).

First turns with a long history (`--first-turns`, default 20 and 128 turns: about 20 and 121 KiB): a new session
whose first request replays a whole history with tool calls and results, after a system prompt and tool
definitions that every session shares. Sessions come in groups (`--group`, the rollouts of one prompt): the
first session of a group brings a history never seen (`fresh`), the others the same request as their group's
first (`sibling`). One client sends them one after another to bare and to ours; printed per size: CPU ms per
request of each and their ratio (bare only parses the body: what any forwarding proxy pays at least).

The floor under the ratio (`bench/_gateway_floor.py`, in this process, no sockets): bare's app and ours' app called
straight as uvicorn calls them, and the turn's own work (JSON in and out, parse, match, render, tokenize, commit)
without HTTP, over sessions of the phases' shape. Bare's request less bare's app is uvicorn's and the kernel's part;
that plus ours' app is the least ours could cost with its app as it is (what it adds in its server above that is
the price of running among the event loop's other work: caches, the collector over the records it keeps), and that
plus the turn's own work alone is the least with the turn as it is and an HTTP glue that cost nothing; printed per
concurrency.

The clients speak minimal HTTP/1.1 over asyncio streams (one write per request, Content-Length bodies
only): an HTTP library's client costs about as much CPU per request as the bare server, and on a small
machine it would cap requests/s below what the servers can do.

    python bench/gateway.py [--turns 32] [--clients 32] [--rounds 2] [--serial 8] [--repeats 3]
                            [--first-turns 20,128] [--groups 3] [--group 4] [--smoke]

Where the CPU goes inside our server: `py-spy record --pid <server pid>` while the bench runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _gateway_server import CHAT_PATH, KINDS, PREFIX, bare_app, build_ours, open_session  # noqa: E402
from _smoke import parse_args  # noqa: E402

SERVER = Path(__file__).resolve().parent / "_gateway_server.py"
"""The script each server process runs."""
WARMUP_SESSIONS = 2
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
RESULT = "Record {i}: the city had about {n} residents at the last census, according to the registry."
FIRST_SYSTEM = "You are a careful research agent: check every record twice and cite the registry. " * 24
FIRST_TOOLS = [{"type": "function", "function": {
    "name": f"registry_{k}", "description": "Look up census records in the regional registry by city and year. " * 6,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "year": {"type": "integer", "description": "census year"}}}}}
    for k in range(4)]
"""The first-turn case's system prompt and tools: the same in every session (a harness's fixed prefix)."""


# --- load process -----------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads Content-Length responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, path: str, token: str, body: bytes) -> bytes:
        head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {token}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
        self.writer.write(head.encode() + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        payload = await self.reader.readexactly(int(headers["content-length"]))
        if lines[0].split()[1] != "200":
            raise RuntimeError(f"{lines[0]}: {payload[:500]!r}")
        return payload

    def close(self) -> None:
        self.writer.close()


@dataclass
class Load:
    """What the clients of one phase saw: per-request latencies and the last request's body size."""

    latencies: list[float] = field(default_factory=list)
    body_bytes: int = 0


async def _session(conn: Connection, session_id: str, turns: int, load: Load) -> None:
    messages = [{"role": "system", "content": "You are a careful agent."},
                {"role": "user", "content": f"Session {session_id}: find the census numbers."}]
    for i in range(turns):
        body = json.dumps({"model": "m", "messages": messages, "tools": TOOLS}).encode()
        start = time.perf_counter()
        reply = await conn.post(CHAT_PATH, session_id, body)
        load.latencies.append(time.perf_counter() - start)
        load.body_bytes = len(body)
        messages += [json.loads(reply)["choices"][0]["message"],
                     {"role": "user", "content": RESULT.format(i=i, n=1000 + i)}]


def first_body(turns: int, history: str) -> bytes:
    """A first request replaying `turns` turns with tool calls; the same bytes for the same `history`."""
    messages = [{"role": "system", "content": FIRST_SYSTEM},
                {"role": "user", "content": f"Task {history}: find the census numbers of every city in the region."}]
    for i in range(turns - 1):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "registry_1", "arguments": json.dumps({"city": f"{history}-{i}", "year": 2000})}}
        messages += [{"role": "assistant", "content": "Checking the next record.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{i}",
                      "content": f"({history}) " + RESULT.format(i=i, n=1000 + i) * 8}]
    return json.dumps({"model": "m", "messages": messages, "tools": FIRST_TOOLS}).encode()


async def _first_turns(port: int, requests: list[tuple[str, bytes]], load: Load) -> None:
    conn = await Connection.open(port)
    try:
        for session_id, body in requests:
            start = time.perf_counter()
            await conn.post(CHAT_PATH, session_id, body)
            load.latencies.append(time.perf_counter() - start)
            load.body_bytes = len(body)
    finally:
        conn.close()


async def _client(port: int, session_ids: list[str], turns: int, load: Load) -> None:
    conn = await Connection.open(port)
    try:
        for session_id in session_ids:
            await _session(conn, session_id, turns, load)
    finally:
        conn.close()


async def drive(port: int, session_ids: list[str], clients: int, turns: int) -> Load:
    """`clients` connections at once, each recording its share of the sessions one after another."""
    load = Load()
    await asyncio.gather(*(_client(port, session_ids[i::clients], turns, load) for i in range(clients)))
    return load


@dataclass(frozen=True)
class Phase:
    """One server under one concurrency: the server's CPU and the clients' view, over the same interval."""

    wall_s: float
    cpu_s: float
    sys_s: float
    """Of `cpu_s`, the kernel's (socket reads and sends, the wake-ups they cause)."""
    load: Load

    @property
    def rate(self) -> float:
        return len(self.load.latencies) / self.wall_s

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s / len(self.load.latencies) * 1e3

    @property
    def sys_ms(self) -> float:
        return self.sys_s / len(self.load.latencies) * 1e3


class Server:
    """A server process (`_gateway_server.py`): its port, its unused session ids, its answers to SIGUSR1 / SIGUSR2."""

    def __init__(self, kind: str, sessions: int, log_dir: str) -> None:
        self.process = subprocess.Popen([sys.executable, str(SERVER), kind, str(sessions), log_dir],
                                        stdout=subprocess.PIPE, text=True)
        info = json.loads(self.process.stdout.readline())
        self.port: int = info["port"]
        self.ids: list[str] = info["ids"]

    def take(self, count: int) -> list[str]:
        taken, self.ids = self.ids[:count], self.ids[count:]
        return taken

    def ask(self, sig: signal.Signals) -> dict[str, Any]:
        self.process.send_signal(sig)
        return json.loads(self.process.stdout.readline())

    def run(self, sessions: int, clients: int, turns: int) -> Phase:
        before, wall0 = self.ask(signal.SIGUSR2), time.perf_counter()
        load = asyncio.run(drive(self.port, self.take(sessions), clients, turns))
        return self._phase(before, wall0, load)

    def first(self, bodies: list[bytes]) -> Phase:
        """One new session per body, one request each, from one client."""
        before, wall0, load = self.ask(signal.SIGUSR2), time.perf_counter(), Load()
        asyncio.run(_first_turns(self.port, list(zip(self.take(len(bodies)), bodies, strict=True)), load))
        return self._phase(before, wall0, load)

    def _phase(self, before: dict[str, float], wall0: float, load: Load) -> Phase:
        wall, after = time.perf_counter() - wall0, self.ask(signal.SIGUSR2)
        return Phase(wall, after["cpu"] - before["cpu"], after["sys"] - before["sys"], load)

    def stop(self) -> None:
        """Stop the server as a run stops (SIGTERM: its run.log is written out); killed if it takes over 30 s."""
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Result:
    """Each server's phases per concurrency (one per repeat), and our RSS and stored tokens around them."""

    phases: dict[str, dict[int, list[Phase]]]
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    access_lines: int = 0
    """Access lines our server wrote to its run.log."""
    first: dict[tuple[str, int, str], list[Phase]] = field(default_factory=dict)
    """(server, history turns, fresh|sibling) → the first-turn phases, one per repeat."""
    first_requests: int = 0
    """Requests ours served in the first-turn case (its warm-up round included)."""
    floor: dict[str, float] = field(default_factory=dict)
    """In this process, no sockets (`measure_floor`): CPU ms per request of bare's app, ours' app, the turn's work."""


def measure(args: argparse.Namespace) -> Result:
    """Both servers up at once; every repeat runs each phase on bare, then on ours, back to back."""
    plan = [(1, args.serial), (args.clients, args.clients * args.rounds)]
    first_turns = [int(t) for t in args.first_turns.split(",") if t]
    total = WARMUP_SESSIONS + args.repeats * sum(sessions for _, sessions in plan)
    total += (1 + args.repeats) * len(first_turns) * args.groups * args.group
    log_dir = tempfile.TemporaryDirectory(prefix="relax-bench-gateway-")
    servers = {kind: Server(kind, total, log_dir.name) for kind in KINDS}
    result = Result({kind: {clients: [] for clients, _ in plan} for kind in KINDS})
    try:
        for server in servers.values():
            server.run(WARMUP_SESSIONS, WARMUP_SESSIONS, args.turns)
        result.before = servers["ours"].ask(signal.SIGUSR1)
        for _ in range(args.repeats):
            for clients, sessions in plan:
                for kind, server in servers.items():
                    result.phases[kind][clients].append(server.run(sessions, clients, args.turns))
        result.after = servers["ours"].ask(signal.SIGUSR1)
        measure_first(servers, result, first_turns, args)
        result.floor = measure_floor(args)
    finally:
        for server in servers.values():
            server.stop()
        run_log = Path(log_dir.name) / "run.log"
        result.access_lines = run_log.read_text().count(" relax_pipeline.gateway.access: ") if run_log.exists() else 0
        log_dir.cleanup()
    return result


def measure_first(servers: dict[str, Server], result: Result, first_turns: list[int], args: argparse.Namespace) -> None:
    """First turns per history size: a warm-up round, then each repeat's fresh and sibling sessions on bare, then
    ours, with histories no earlier round used."""
    for repeat in range(1 + args.repeats):
        for turns in first_turns:
            histories = [f"r{repeat}-t{turns}-g{g}" for g in range(args.groups)]
            fresh = [first_body(turns, history) for history in histories]
            siblings = [body for body in fresh for _ in range(args.group - 1)]
            for kind in ("bare", "ours"):
                for name, bodies in (("fresh", fresh), ("sibling", siblings)):
                    phase = servers[kind].first(bodies)
                    result.first_requests += len(bodies) if kind == "ours" else 0
                    if repeat and bodies:
                        result.first.setdefault((kind, turns, name), []).append(phase)


def measure_floor(args: argparse.Namespace) -> dict[str, float]:
    """CPU ms per request in this process, apps called straight (`bench/_gateway_floor.py`): bare's app, ours' app
    (run logging on, as the server runs it) and the turn's own work, each over sessions of the phases' shape."""
    from relax_pipeline.tracking.logs import run_logging

    with tempfile.TemporaryDirectory(prefix="relax-bench-floor-") as logs, run_logging(Path(logs)):
        return asyncio.run(_measure_floor(args))


async def _measure_floor(args: argparse.Namespace) -> dict[str, float]:
    from _gateway_floor import AppCall, TurnWork

    from relax_pipeline.gateway.app import create_app
    from relax_pipeline.loop import settle_garbage

    sessions, floor = WARMUP_SESSIONS + max(args.serial, 1) * args.repeats, {}
    bare_ids = [f"s{i}" for i in range(sessions)]
    ours_store, ours_turns = build_ours()
    work_store, work_turns = build_ours()
    callers = {"bare_app": (AppCall(bare_app()), bare_ids),
               "ours_app": (AppCall(create_app(ours_store, ours_turns, prefix=PREFIX)),
                            [open_session(ours_store, i) for i in range(sessions)]),
               "turn": (TurnWork(work_store, work_turns), [open_session(work_store, i) for i in range(sessions)])}
    settle_garbage(full=True)
    for name, (caller, ids) in callers.items():
        for index, session_id in enumerate(ids):
            if index == WARMUP_SESSIONS:
                caller.reset()
            await _session(caller, session_id, args.turns, Load())  # type: ignore[arg-type] - a Connection stand-in
        floor[name] = caller.cpu_ms
    return floor


def percentile_ms(phases: list[Phase], q: int) -> float:
    latencies = [latency for phase in phases for latency in phase.load.latencies]
    return statistics.quantiles(latencies, n=100, method="inclusive")[q - 1] * 1e3


def report(result: Result, args: argparse.Namespace) -> None:
    body_kib = result.phases["ours"][args.clients][-1].load.body_bytes / 1024
    print(f"sessions of {args.turns} turns on keep-alive connections (last request body {body_kib:.1f} KiB); "
          f"{args.repeats} repeats, bare and ours back to back; requests/s and CPU: median of repeats")
    print(f"{'server':<7} {'clients':>7} {'requests':>8} {'requests/s':>10} {'CPU ms/request':>14} "
          f"{'p50 ms':>7} {'p99 ms':>7}")
    for kind, by_clients in result.phases.items():
        for clients, phases in by_clients.items():
            rate = statistics.median(p.rate for p in phases)
            cpu = statistics.median(p.cpu_ms for p in phases)
            print(f"{kind:<7} {clients:>7} {sum(len(p.load.latencies) for p in phases):>8} {rate:>10.0f} "
                  f"{cpu:>14.3f} {percentile_ms(phases, 50):>7.2f} {percentile_ms(phases, 99):>7.2f}")
    _report_ratios(result, args)
    _report_floor(result)
    _report_first(result)
    _report_tracing(result)
    _report_memory(result)
    requests = sum(len(p.load.latencies) for p in result.phases["ours"][args.clients] + result.phases["ours"][1])
    _report_collector(result.after["gc"], requests)
    print(f"ours access lines in run.log: {result.access_lines} for {requests} measured requests, "
          f"{WARMUP_SESSIONS * args.turns} warm-up requests and {result.first_requests} first turns")


def _report_ratios(result: Result, args: argparse.Namespace) -> None:
    ours, bare = result.phases["ours"], result.phases["bare"]
    parts = []
    for clients in ours:
        ratios = sorted(o.cpu_ms / b.cpu_ms for o, b in zip(ours[clients], bare[clients], strict=True))
        parts.append(f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) at {clients} client(s)")
    print(f"ours / bare CPU per request, median (range) of the repeats: {', '.join(parts)}; target <= 1.5x")
    kernel = [f"ours {statistics.median(p.sys_ms for p in ours[c]):.3f}, "
              f"bare {statistics.median(p.sys_ms for p in bare[c]):.3f} at {c} client(s)" for c in ours]
    print(f"of which the kernel's (socket reads, sends, wake-ups; Linux splits CPU time by tick samples, so rough), "
          f"ms per request: {'; '.join(kernel)}")
    rates = {kind: statistics.median(p.rate for p in result.phases[kind][args.clients]) for kind in KINDS}
    print(f"requests/s at {args.clients} clients: ours {rates['ours']:.0f}, bare {rates['bare']:.0f}, "
          f"ours / bare {rates['ours'] / rates['bare']:.2f}; target >= 500")


def _report_floor(result: Result) -> None:
    """The floors under the ratio: uvicorn's and the kernel's part of bare's request (bare less bare's app called
    straight) plus ours' app called straight (everything it does: the access line, the disconnect watch, the
    credential), and plus the turn's own work alone; and what ours costs in its server above the first."""
    floor = result.floor
    print(f"in this process, no sockets (bench/_gateway_floor.py), CPU ms per request: bare's app "
          f"{floor['bare_app']:.3f}; ours' app {floor['ours_app']:.3f}, of which the turn's own work (JSON in and "
          f"out, parse, match, render, tokenize, commit) {floor['turn']:.3f}")
    for name, part in (("ours' app", "ours_app"), ("the turn's own work", "turn")):
        parts = []
        for clients, phases in result.phases["bare"].items():
            bare = statistics.median(p.cpu_ms for p in phases)
            ours = statistics.median(p.cpu_ms for p in result.phases["ours"][clients])
            server, least = bare - floor["bare_app"], bare - floor["bare_app"] + floor[part]
            parts.append(f"{server:.3f} + {floor[part]:.3f} = {least:.3f} ms, {least / bare:.2f}x at {clients} "
                         f"client(s) (ours above it: {ours - least:+.3f} ms)")
        print(f"floor of ours / bare, uvicorn and the kernel under bare's app (bare - bare's app) plus {name}: "
              f"{'; '.join(parts)}")


def _report_first(result: Result) -> None:
    """First turns with a long history: CPU per request of bare and ours per size, fresh and sibling sessions."""
    sizes = sorted({turns for _, turns, _ in result.first})
    for turns in sizes:
        parts = []
        for name in ("fresh", "sibling"):
            ours, bare = result.first.get(("ours", turns, name)), result.first.get(("bare", turns, name))
            if not ours or not bare:
                continue
            o, b = statistics.median(p.cpu_ms for p in ours), statistics.median(p.cpu_ms for p in bare)
            p50 = statistics.median(latency for p in ours for latency in p.load.latencies) * 1e3
            parts.append(f"{name} ours {o:.2f} ms, bare {b:.2f} ms ({o / b:.1f}x), ours p50 {p50:.1f} ms")
        kib = result.first[("ours", turns, "fresh")][-1].load.body_bytes / 1024
        print(f"first turn, {turns}-turn history ({kib:.0f} KiB), CPU per request: {'; '.join(parts)}")


def _report_tracing(result: Result) -> None:
    """Ours' CPU per request with session traces on vs off, per concurrency (median of the repeats' differences)."""
    parts = []
    for clients, traced in result.phases["traced"].items():
        off = result.phases["ours"][clients]
        extra = sorted(t.cpu_ms - o.cpu_ms for t, o in zip(traced, off, strict=True))
        base = statistics.median(o.cpu_ms for o in off)
        parts.append(f"{statistics.median(t.cpu_ms for t in traced):.3f} vs {base:.3f} ms "
                     f"({statistics.median(extra) * 1e3:+.1f} us, {statistics.median(extra) / base:+.1%}) at {clients} "
                     "client(s)")
    print(f"tracing: ours CPU per request with session traces on vs off: {'; '.join(parts)}")


def _report_memory(result: Result) -> None:
    grown = result.after["rss"] - result.before["rss"]
    tokens = result.after["tokens"] - result.before["tokens"]
    print(f"ours memory: RSS +{grown / 2**20:.1f} MiB for {tokens:.0f} tokens stored during the phases: "
          f"{grown / max(tokens, 1):.0f} bytes per stored token (RSS {result.after['rss'] / 2**20:.0f} MiB, "
          f"{result.after['tokens']:.0f} tokens in the forests)")


def _report_collector(collected: dict[str, list[float]], requests: int) -> None:
    gens = ", ".join(f"gen{g} {collected['count'][g]:.0f} in {collected['spent'][g] * 1e3:.0f} ms" for g in range(3))
    print(f"ours garbage collector during the phases (CPU): {gens}; longest full collection "
          f"{collected['longest'][2] * 1e3:.1f} ms; {sum(collected['spent']) / requests * 1e6:.1f} us per request")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=32, help="turns per session")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients in phase two")
    parser.add_argument("--rounds", type=int, default=2, help="sessions per client in phase two")
    parser.add_argument("--serial", type=int, default=8, help="sessions one after another in phase one")
    parser.add_argument("--repeats", type=int, default=3, help="times each phase runs on each server")
    parser.add_argument("--first-turns", default="20,128", help="history turns of the first-turn case (comma list)")
    parser.add_argument("--groups", type=int, default=3, help="first-turn case: histories (groups) per size and repeat")
    parser.add_argument("--group", type=int, default=4, help="first-turn case: sessions per group (same first request)")
    args = parse_args(parser, turns=2, clients=2, rounds=1, serial=1, repeats=1, first_turns="3", groups=1, group=2)
    report(measure(args), args)


if __name__ == "__main__":
    main()
