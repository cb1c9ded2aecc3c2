"""Raw ASGI pieces under the gateway's model routes: dispatch, body, disconnect watch, JSON responses.

A model turn is the gateway's only hot path, and FastAPI's routing, middleware and dependency machinery
cost about as much CPU per request as a bare endpoint's whole work. `GatewayApp` sends a POST on one
of the exact model paths straight to its `TurnRoute` and everything else (health, models, count_tokens,
unknown routes, wrong methods, trailing slashes) to the FastAPI app, where the same routes are also
registered, so every answer the FastAPI app gave is still given. Repeated slashes in a path (a base URL
ending in `/` joined with `/chat/completions`) are read as one. `DisconnectWatch` cancels a turn when
its client goes away, without a second task for the turn or a polling timer; `json_response` renders
with orjson (compact UTF-8, as Starlette's JSONResponse writes it). This module holds no routes and no
turn logic (`app.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

TurnHandler = Callable[[Scope, Receive], Awaitable[Response]]


class GatewayApp:
    """The ASGI entry point: model turns by exact path, everything else through `fallback`."""

    def __init__(self, fallback: ASGIApp, routes: Mapping[str, TurnRoute]) -> None:
        self.fallback = fallback
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if "//" in scope.get("path", ""):  # a base URL ending in "/" joined with "/chat/completions"
            scope = {**scope, "path": _single_slashes(scope["path"])}
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        await (route or self.fallback)(scope, receive, send)


def _single_slashes(path: str) -> str:
    while "//" in path:
        path = path.replace("//", "/")
    return path


class TurnRoute:
    """One model path as a plain ASGI app (Starlette mounts an object like this without wrapping it)."""

    def __init__(self, handle: TurnHandler) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handle(scope, receive)
        await response(scope, receive, send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) request header, as Starlette's `Headers.get` reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class DisconnectWatch:
    """Cancels `task` if the client disconnects before `stop()`; `fired` tells whether it did.

    After the body, the next message `receive` gives is the disconnect, so one waiter task suffices. It is
    started on the loop's next iteration, so a turn that finishes without waiting (an engine that answers
    at once) costs one cancelled callback instead of a task.
    """

    def __init__(self, task: asyncio.Task[Any], receive: Receive) -> None:
        self.task = task
        self.fired = False
        self._receive = receive
        self._waiter: asyncio.Future[Any] | None = None
        self._start = asyncio.get_running_loop().call_soon(self._wait)

    def _wait(self) -> None:
        self._waiter = asyncio.ensure_future(self._receive())
        self._waiter.add_done_callback(self._done)

    def _done(self, waiter: asyncio.Future[Any]) -> None:
        if waiter.cancelled() or waiter.exception() is not None or self._start.cancelled():
            return
        if waiter.result()["type"] == "http.disconnect":
            self.fired = True
            self.task.cancel()

    def stop(self) -> None:
        self._start.cancel()
        if self._waiter is not None:
            self._waiter.cancel()


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """`body` as compact UTF-8 JSON (orjson; the standard library for what orjson refuses)."""
    try:
        payload = orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError: big ints, non-string keys
        payload = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return Response(payload, status_code=status, media_type="application/json", headers=headers)
