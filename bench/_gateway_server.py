"""The server processes of `bench/gateway.py`: bare FastAPI, our gateway as a run serves it, and ours with traces.

`python bench/_gateway_server.py KIND SESSIONS LOG_DIR` runs one server (KIND: `bare`, `ours` or `traced`), prints
its port and SESSIONS session ids as one JSON line, and serves until SIGTERM; SIGUSR1 prints its RSS after a full
collection, the tokens its forests hold and its collector's work since the last report (`GcClock`), SIGUSR2 its CPU
seconds so far (the traced server first traces every session with new turns, as a step's end does). `build_ours` is
also the floor's (`bench/_gateway_floor.py`): the store and turn service the server wraps.

This module is a helper, not a bench (its name starts with `_`, which the smoke test skips); it measures nothing
itself and holds no load generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

PREFIX = "/agentic_api"
CHAT_PATH = f"{PREFIX}/v1/chat/completions"
KINDS = ("bare", "ours", "traced")
"""`traced`: ours with session traces written (see `bench/gateway.py`)."""
ANSWER = "I looked at the record and the number is 1234; continuing with the next part of the task now."


def serve(kind: str, sessions: int, log_dir: str) -> None:
    """Run one server; print its port and session ids as one JSON line, then serve until SIGTERM.

    SIGUSR1 prints one JSON line: the process's RSS after `gc.collect()` and the tokens its forests hold;
    SIGUSR2 prints its CPU seconds so far (all threads, microsecond resolution, unlike /proc's clock ticks).
    """
    from relax_pipeline.tracking.logs import run_logging

    logs = Path(log_dir) / ("traced" if kind == "traced" else "")  # the traced server logs the same, elsewhere
    with run_logging(logs) if kind != "bare" else contextlib.nullcontext():
        asyncio.run(_serve(kind, sessions))


async def _serve(kind: str, sessions: int) -> None:
    store = None
    if kind != "bare":
        server, store = await start_ours()
        port, ids = server.port, [open_session(store, i) for i in range(sessions)]
    else:
        server, ids = await _start_bare(), [f"s{i}" for i in range(sessions)]
        port = server.servers[0].sockets[0].getsockname()[1]
    gc.callbacks.append(GC_CLOCK)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _report_memory_use, store)
    report = Tracing(store).report_cpu if kind == "traced" else _report_cpu
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, report)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"port": port, "ids": ids}), flush=True)
    await stop.wait()  # a clean stop, as a run's: `serve` then leaves `run_logging`, which writes out run.log
    await (server.stop() if kind != "bare" else server.shutdown())


async def start_ours() -> tuple[Any, Any]:
    """The gateway as `run.py` serves it: `create_app` under `GatewayServer.start()` in this loop, garbage
    settled as before a step (`serve` turned run logging on)."""
    from relax_pipeline.gateway.app import create_app
    from relax_pipeline.gateway.server import GatewayServer
    from relax_pipeline.loop import settle_garbage

    store, turns = build_ours()
    server = GatewayServer(create_app(store, turns, prefix=PREFIX), prefix=PREFIX)
    await server.start()
    settle_garbage(full=True)
    return server, store


def build_ours() -> tuple[Any, Any]:
    """Our gateway's forest store and turn service over the tiny model's tokenizer and an instant scripted engine."""
    from transformers import AutoTokenizer

    from relax_pipeline.chat.parsers import OutputParser
    from relax_pipeline.chat.template import ChatTemplate
    from relax_pipeline.models.tiny import build_tiny
    from relax_pipeline.testing.engines import ScriptedEngine
    from relax_pipeline.turn.service import SamplingDefaults, TurnService
    from relax_pipeline.turn.sessions import ForestStore

    tokenizer = AutoTokenizer.from_pretrained(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    engine = ScriptedEngine(tokenizer, [ANSWER], record_prompts=False)
    turns = TurnService(ChatTemplate(tokenizer), engine, OutputParser(),
                        SamplingDefaults(max_context_len=1 << 20, max_response_len=256))
    return ForestStore(), turns


def open_session(store: Any, index: int) -> str:
    from relax_pipeline.turn.sessions import Status

    session = store.open("g", index, 0, "train", {})
    store.set_status(session, Status.RUNNING)
    return session.key


async def _start_bare() -> Any:
    import uvicorn

    config = uvicorn.Config(bare_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            access_log=False, timeout_keep_alive=30, backlog=2048)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    return server


def bare_app() -> FastAPI:
    app = FastAPI()
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> JSONResponse:
        json.loads(await request.body())
        return JSONResponse(reply)

    return app


def _report_cpu() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu": usage.ru_utime + usage.ru_stime, "sys": usage.ru_stime}), flush=True)


class Tracing:
    """The traced server's step end: every session with new turns traced (spans built, OTLP JSON written) before its
    CPU is reported, so each phase pays for its own sessions' traces."""

    def __init__(self, store: Any) -> None:
        from relax_pipeline.tracking.traces import TraceWriter

        self.store = store
        self.folder = tempfile.TemporaryDirectory(prefix="relax-bench-traces-")
        self.writer = TraceWriter(self.folder.name)
        self.traced: dict[str, int] = {}
        """Session id → the turns it had when last traced."""
        self.step = 0

    def report_cpu(self) -> None:
        from relax_pipeline.data.dataset import Prompt
        from relax_pipeline.stages.group import Group
        from relax_pipeline.stages.traces import session_trace

        ended = [s for s in self.store if s.forest.turn_count > self.traced.get(s.id, 0)]
        records = [session_trace(Group("g", Prompt(0, None), 0, "train", Path(self.folder.name), [s]), s, self.step)
                   for s in ended]
        self.writer.submit(self.step, records)
        self.writer.flush()
        self.traced.update((s.id, s.forest.turn_count) for s in ended)
        self.step += 1
        _report_cpu()


@dataclass
class GcClock:
    """A `gc.callbacks` entry: per generation, the collections since `reset`, their CPU seconds, the longest."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    spent: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.thread_time()
            return
        generation, took = info["generation"], time.thread_time() - self.started
        self.count[generation] += 1
        self.spent[generation] += took
        self.longest[generation] = max(self.longest[generation], took)

    def reset(self) -> None:
        self.count, self.spent, self.longest = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]


GC_CLOCK = GcClock()


def _report_memory_use(store: Any) -> None:
    """RSS after a full collection, stored tokens, and the collector's work since the previous report."""
    collected = {"count": GC_CLOCK.count, "spent": GC_CLOCK.spent, "longest": GC_CLOCK.longest}
    gc.collect()
    GC_CLOCK.reset()
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    tokens = sum(len(node.token_ids) for session in store for node in session.forest.nodes) if store else 0
    print(json.dumps({"rss": rss, "tokens": tokens, "gc": collected}), flush=True)


if __name__ == "__main__":
    kind, sessions, log_dir = sys.argv[1:4]
    if kind not in KINDS:
        raise SystemExit(f"usage: _gateway_server.py {{{'|'.join(KINDS)}}} SESSIONS LOG_DIR (got {kind!r})")
    serve(kind, int(sessions), log_dir)
