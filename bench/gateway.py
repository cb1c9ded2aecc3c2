"""Gateway throughput over real HTTP: our gateway vs a bare FastAPI endpoint, side by side in one run.

A server process runs under uvicorn on 127.0.0.1 with an engine that answers instantly (the scripted
fake), so what is measured is the gateway: HTTP, parsing, canonicalizing, matching, committing and the
delta tokenization. The baseline is a bare FastAPI endpoint that reads the same bodies and returns a
fixed chat completion. A load process drives `--sessions` concurrent sessions (default 32), each
replaying its growing history for `--turns` turns (default 32), and prints requests/s and the server's
CPU milliseconds per request for both, and their ratio (DESIGN §5: ≥ 500 requests/s, ≤ 2 ms CPU).

    python bench/gateway.py [--sessions 32] [--turns 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ANSWER = "I looked at the record and the number is 1234; continuing with the next part of the task now."
RESULT = "Record {i}: the city had about {n} residents at the last census, according to the registry."


def serve(kind: str, sessions: int) -> None:
    """Run one server; print its port and session ids as one JSON line, then serve until killed."""
    import uvicorn

    app, ids = _bare_app(sessions) if kind == "bare" else _our_app(sessions)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(json.dumps({"port": port, "ids": ids}), flush=True)
        await task

    asyncio.run(main())


def _our_app(sessions: int):  # noqa: ANN202
    from transformers import AutoTokenizer

    from relax_pipeline.engine.parsers import OutputParser
    from relax_pipeline.engine.template import ChatTemplate
    from relax_pipeline.gateway.app import create_app
    from relax_pipeline.models.tiny import build_tiny
    from relax_pipeline.testing.engines import ScriptedEngine
    from relax_pipeline.turn.service import SamplingDefaults, TurnService
    from relax_pipeline.turn.sessions import ForestStore, Status

    tokenizer = AutoTokenizer.from_pretrained(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    template = ChatTemplate(tokenizer)
    turns = TurnService(template, ScriptedEngine(tokenizer, [ANSWER], record_prompts=False), OutputParser(),
                        SamplingDefaults(max_context_len=1 << 20, max_response_len=256))
    store = ForestStore()
    ids = []
    for i in range(sessions):
        session = store.open("g", i, 0, "train", {})
        store.set_status(session, Status.RUNNING)
        ids.append(session.id)
    return create_app(store, turns, prefix="/agentic_api"), ids


def _bare_app(sessions: int):  # noqa: ANN202
    app = FastAPI()
    reply = {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    @app.post("/agentic_api/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        json.loads(await request.body())
        return JSONResponse(reply)

    return app, [f"s{i}" for i in range(sessions)]


async def drive(port: int, ids: list[str], turns: int) -> int:
    """Every session replays its growing history for `turns` turns; returns the number of requests."""
    limits = httpx.Limits(max_connections=len(ids), max_keepalive_connections=len(ids))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/agentic_api/v1/", limits=limits,
                                 timeout=60) as client:
        counts = await asyncio.gather(*(_session(client, sid, turns) for sid in ids))
    return sum(counts)


async def _session(client: httpx.AsyncClient, session_id: str, turns: int) -> int:
    messages = [{"role": "system", "content": "You are a careful agent."},
                {"role": "user", "content": f"Session {session_id}: find the census numbers."}]
    for i in range(turns):
        response = await client.post("chat/completions", headers={"Authorization": f"Bearer {session_id}"},
                                     json={"model": "m", "messages": messages, "tools": TOOLS})
        response.raise_for_status()
        messages += [response.json()["choices"][0]["message"],
                     {"role": "user", "content": RESULT.format(i=i, n=1000 + i)}]
    return turns


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, sessions: int, turns: int) -> tuple[float, float]:
    """Requests/s and server CPU ms per request for one server kind."""
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--sessions", str(sessions)],
                              stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(server.stdout.readline())
        cpu0, wall0 = cpu_seconds(server.pid), time.perf_counter()
        requests = asyncio.run(drive(info["port"], info["ids"], turns))
        wall, cpu = time.perf_counter() - wall0, cpu_seconds(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait()
    return requests / wall, cpu / requests * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--serve", choices=("ours", "bare"))
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.sessions)
    rows = {kind: measure(kind, args.sessions, args.turns) for kind in ("bare", "ours")}
    print(f"{args.sessions} sessions x {args.turns} turns, histories replayed in full")
    print(f"{'server':<8} {'requests/s':>11} {'server CPU ms/request':>22}")
    for kind, (rate, cpu) in rows.items():
        print(f"{kind:<8} {rate:>11.0f} {cpu:>22.2f}")
    print(f"ours / bare: throughput {rows['ours'][0] / rows['bare'][0]:.2f}, "
          f"CPU per request {rows['ours'][1] / rows['bare'][1]:.1f}x (targets: >= 500 requests/s, <= 2 ms CPU)")


if __name__ == "__main__":
    main()
