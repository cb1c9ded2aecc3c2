"""How many of our source files one Chat Completions turn runs, from the route handler to the forest commit.

The turn path should be readable whole: a newcomer following one request from the gateway's route to
the committed nodes opens at most `MAX_FILES` files of `relax_pipeline`. This test drives one chat
request (and then a continuation of it) through the gateway's ASGI app in-process, with the scripted
engine and the real tokenizer, chat template, parser and forest, and records with `sys.setprofile`
every `relax_pipeline` source file whose code runs between the route handler's entry and the return
of the forest's commit. The engine's own file (`testing/engines.py`, a stand-in for the real engine) is
not counted. The session holds no group lease; under one (a training run), `turn/leases.py` joins the walk
while the request waits for its lease. On failure it prints the list (`pytest -s` prints it always).

No server and no subprocess: the app is called as an ASGI callable with a hand-written receive/send.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import relax_pipeline
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.forest.store import SessionForest
from relax_pipeline.gateway.app import GatewayApp, create_app
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore, Session, Status

MAX_FILES = 11
"""8 until the word cache (`chat/words.py`, issue 33 item 2) joined the walk (`template.py` has no room for it), 9
until the session memo left `canonical/form.py` for `canonical/memo.py` (form.py had no room for issue 33's
shortcuts), 10 until the template's fast paths left `chat/template.py` for `chat/codec.py` (the same)."""
PACKAGE = Path(relax_pipeline.__file__).resolve().parent
PATH = "/agentic_api/v1/chat/completions"
ENGINE_FILES = {"testing/engines.py"}
"""The stand-in engine: the real one (engine/hf/engine.py or engine/sglang/client.py) would run here instead."""
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'


class WalkRecorder:
    """Records the package files whose functions are called while it is on (a `sys.setprofile` hook)."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self._roots = str(PACKAGE) + "/"

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self._roots):
            self.files.add(frame.f_code.co_filename[len(self._roots):])

    def start(self) -> None:
        sys.setprofile(self.hook)

    @staticmethod
    def stop() -> None:
        sys.setprofile(None)

    @property
    def counted(self) -> list[str]:
        return sorted(self.files - ENGINE_FILES)


def record_walk(app: GatewayApp, forest: SessionForest, recorder: WalkRecorder) -> None:
    """Turn the recorder on when the route's handler is entered and off when the forest commit returns."""
    route = app.routes[PATH]
    handle = route.handle

    async def traced(scope: dict[str, Any], receive: Callable[[], Any]) -> Any:
        recorder.start()
        try:
            return await handle(scope, receive)
        finally:
            recorder.stop()

    commit = forest.commit

    def committed(*args: Any, **kwargs: Any) -> Any:
        try:
            return commit(*args, **kwargs)
        finally:
            recorder.stop()

    route.handle = traced
    forest.commit = committed  # type: ignore[method-assign]


async def post(app: GatewayApp, session: Session, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One POST through the ASGI app, as uvicorn would call it."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {session.key}".encode()), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": PATH, "raw_path": PATH.encode(), "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    await app(scope, receive, send)
    body_bytes = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body_bytes)


def gateway(template: ChatTemplate) -> tuple[GatewayApp, ForestStore]:
    engine = ScriptedEngine(template.tokenizer, [CALL])
    turns = TurnService(template, engine, OutputParser(), SamplingDefaults())
    store = ForestStore()
    return create_app(store, turns), store


def walk_report(label: str, files: list[str]) -> str:
    return f"{label}: {len(files)} files (at most {MAX_FILES}):\n  " + "\n  ".join(files)


@pytest.mark.asyncio
async def test_a_chat_turn_runs_in_at_most_eight_files(template: ChatTemplate) -> None:
    app, store = gateway(template)
    session = store.open("group-0", 0, 0, "train", {"messages": []})
    store.set_status(session, Status.RUNNING)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1?"}]
    walks = {}
    recorder = WalkRecorder()
    record_walk(app, session.forest, recorder)
    for label in ("first turn", "second turn"):
        recorder.files.clear()
        status, body = await post(app, session, {"model": "m", "messages": messages, "tools": TOOLS})
        assert status == 200, body
        walks[label] = recorder.counted
        print(walk_report(label, recorder.counted))
        assert ENGINE_FILES <= recorder.files and "forest/store.py" in recorder.files, "the walk missed the turn"
        reply = body["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "2"}]
    assert [n.kind for n in session.forest.nodes] == ["root", "observation", "response", "observation", "response"]
    too_long = {label: files for label, files in walks.items() if len(files) > MAX_FILES}
    assert not too_long, "\n".join(walk_report(label, files) for label, files in too_long.items())
