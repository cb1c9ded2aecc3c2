"""The two floors under `bench/gateway.py`'s ratio, measured in the bench's own process, without sockets.

Our gateway's CPU per request is an HTTP server's (uvicorn: reading and parsing the request, writing the
response, the event loop) plus what the app does on top. The bench's servers report the whole; this module
splits it, so the report can say what the ratio could be at best with the turn's recording as it is:

- `TurnWork` answers a request with the turn's own work, called as the gateway calls it, and nothing else: the
  body's JSON in (orjson), `ChatFrontend.parse`, `TurnService.prepare` and `run_prepared` (the scripted engine
  answers at once; the forest commits), `ChatFrontend.render` and the JSON out, and the response id remembered.
  No HTTP, no ASGI call, no credential check, no access line: what any server recording token-exact turns pays.
- `app_cpu_ms` times an ASGI app called straight (a request message in, the response messages kept), as
  uvicorn calls it: bare's app there, so bare's whole request less this is uvicorn's and the kernel's part
  (bare's and ours' are the same uvicorn, with the same keep-alive connections).

So uvicorn's part plus the turn's work is the least our gateway could cost per request if its HTTP glue cost
nothing. Both run here as loops with warm caches: lower bounds on what the same work costs inside a server
that interleaves it with the event loop's. CPU is this process's time (`time.process_time`) inside the call
only; building each request body is the client's work and is not counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson


class Timed:
    """CPU seconds spent in the calls counted, and their count (`reset` after a warm-up)."""

    def __init__(self) -> None:
        self.cpu_s, self.requests = 0.0, 0

    def count(self, started: float) -> None:
        self.cpu_s += time.process_time() - started
        self.requests += 1

    def reset(self) -> None:
        self.cpu_s, self.requests = 0.0, 0

    @property
    def cpu_ms(self) -> float:
        return self.cpu_s / max(self.requests, 1) * 1e3


class TurnWork(Timed):
    """A bench `Connection` stand-in: `post` answers with the turn's own work in this process (see the module)."""

    def __init__(self, store: Any, turns: Any) -> None:
        from relax_pipeline.protocol.chat import ChatFrontend

        super().__init__()
        self.store, self.turns, self.frontend = store, turns, ChatFrontend()

    async def post(self, path: str, token: str, body: bytes) -> bytes:
        started = time.process_time()
        reply = await self._answer(token, body)
        self.count(started)
        return reply

    async def _answer(self, token: str, body: bytes) -> bytes:
        from relax_pipeline.protocol.base import TurnMeta

        session = self.store.authenticate(token)
        turn = self.frontend.parse(orjson.loads(body), session.memo)
        prepared = self.turns.prepare(session.forest, turn, session.turn_seed(), session.mode)
        result = await self.turns.run_prepared(session.forest, prepared, session=session)
        meta = TurnMeta(f"chat-{self.requests:024x}", int(time.time()), "m")
        reply = orjson.dumps(self.frontend.render(result, meta))
        self.store.remember_response(session, meta.response_id, result.node_id)
        return reply


class AppCall(Timed):
    """A bench `Connection` stand-in that calls an ASGI `app` straight, as uvicorn would, timing only the call."""

    def __init__(self, app: Any) -> None:
        super().__init__()
        self.app = app

    async def post(self, path: str, token: str, body: bytes) -> bytes:
        sent: list[dict[str, Any]] = []
        scope = _scope(path, token, len(body))
        receive, send = _receiver(body), _sender(sent)
        started = time.process_time()
        await self.app(scope, receive, send)
        self.count(started)
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _scope(path: str, token: str, length: int) -> dict[str, Any]:
    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {token}".encode()),
               (b"content-type", b"application/json"), (b"content-length", str(length).encode())]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}


def _receiver(body: bytes):  # noqa: ANN202 - an ASGI receive callable
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client never leaves: a disconnect watch waits here until cancelled
        return {"type": "http.disconnect"}

    return receive


def _sender(sent: list[dict[str, Any]]):  # noqa: ANN202 - an ASGI send callable
    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    return send
