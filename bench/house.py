"""The house in figures: what a reader meets, printed, never checked.

Three reports of the package's shape, for reading, not for gating (a module is as long as its one responsibility
needs; STYLE.md habit 12):

- the largest modules by line count;
- the configured classes with the most constructor parameters (a record plus its live collaborators);
- the source files of `relax_pipeline` that one Chat Completions turn runs, from the gateway route's entry to
  the forest's commit: one chat request and a continuation of it through the ASGI app in-process, with the
  scripted engine (`testing/engines.py`, not counted) and the real tokenizer, chat template, parser and forest,
  recorded with `sys.setprofile`.

    python bench/house.py [--top 10]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from _smoke import parse_args
from transformers import AutoTokenizer

import relax_pipeline
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.forest.store import SessionForest
from relax_pipeline.gateway.app import GatewayApp, create_app
from relax_pipeline.models.tiny import build_tiny
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore, Session, Status

PACKAGE = Path(relax_pipeline.__file__).resolve().parent
PATH = "/agentic_api/v1/chat/completions"
ENGINE_FILES = {"testing/engines.py"}
"""The stand-in engine: the real one (engine/hf/engine.py or engine/sglang/client.py) would run here instead."""
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'


def module_lines() -> list[tuple[int, str]]:
    """(lines, module) for every module of the package, longest first."""
    found = [(len(p.read_text().splitlines()), p.relative_to(PACKAGE).as_posix()) for p in PACKAGE.rglob("*.py")]
    return sorted(found, reverse=True)


def constructor_parameters() -> list[tuple[int, str]]:
    """(parameters, class) for every class of the package that defines `__init__`, most first."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        a = item.args
                        count = len(a.posonlyargs + a.args + a.kwonlyargs) - 1
                        found.append((count, f"{path.relative_to(PACKAGE).as_posix()}::{node.name}"))
    return sorted(found, reverse=True)


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
    """The gateway's app on the scripted engine (one tool call) and the real template, parser and forest."""
    engine = ScriptedEngine(template.tokenizer, [CALL])
    turns = TurnService(template, engine, OutputParser(), SamplingDefaults())
    store = ForestStore()
    return create_app(store, turns), store


async def turn_walks(template: ChatTemplate) -> dict[str, list[str]]:
    """The files of the package each of two chat turns runs (a tool call, then its result)."""
    app, store = gateway(template)
    session = store.open("group-0", 0, 0, "train", {"messages": []})
    store.set_status(session, Status.RUNNING)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1?"}]
    walks = {}
    recorder = WalkRecorder()
    record_walk(app, session.forest, recorder)
    for label in ("first", "second"):
        recorder.files.clear()
        status, body = await post(app, session, {"model": "m", "messages": messages, "tools": TOOLS})
        if status != 200 or "forest/store.py" not in recorder.files:
            raise SystemExit(f"the {label} turn did not run through the forest: {status} {body}")
        walks[label] = recorder.counted
        reply = body["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "2"}]
    return walks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=10, help="rows of each list")
    args = parse_args(parser, top=3)
    print(f"largest modules (of {len(module_lines())}):")
    for lines, name in module_lines()[: args.top]:
        print(f"  {lines:5d}  {name}")
    print("most constructor parameters:")
    for count, name in constructor_parameters()[: args.top]:
        print(f"  {count:5d}  {name}")
    template = ChatTemplate(AutoTokenizer.from_pretrained(build_tiny()))
    walks = asyncio.run(turn_walks(template))
    for label, files in walks.items():
        print(f"{label} turn: " + ", ".join(files))
    print(f"files a chat turn runs: first {len(walks['first'])}, second {len(walks['second'])}")


if __name__ == "__main__":
    main()
