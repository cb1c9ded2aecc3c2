"""A fake agent server for `agent.executor=http` tests: the wire contract of `agent/http_executor.py`, with
the agent replaced by a Python handler.

`FakeAgentServer(handler)` serves `POST /sessions`, `DELETE /sessions/{id}` and `GET /health` from uvicorn on
127.0.0.1 and a free port, in a background thread, so sync and async tests can use it alike. Each POST runs
`handler(body, cancelled)` in a worker thread (sessions run concurrently); `cancelled` is a `threading.Event`
set by the session's DELETE. The server records every POST body (`received`) and every DELETE (`deleted`).

Handlers: `chat_once` (one Chat Completions call through the gateway with the session's key, then reward 1.0),
`failing(code, log)` (answers that exit code and log), `hanging` (waits for its DELETE). It is a fake edge:
it runs no process and no sandbox (`examples/mini_swe_agent/server.py` is the real one).

`python -m relax_pipeline.testing.agent_server --port N` serves `chat_once` in the foreground, as a run's
`agent.services` (or `eval.agent.services`) entry starts it, and prints one line per session it ran
(`session <id> mode <RELAX_ROLLOUT_MODE>`) to its log.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

Handler = Callable[[dict[str, Any], threading.Event], dict[str, Any]]
"""(POST body, cancelled) → the answer `{"exit_code", "output", "log"}`."""


def chat_once(body: dict[str, Any], cancelled: threading.Event) -> dict[str, Any]:
    """One model call with the session's input messages through the gateway; exports implicitly, reward 1.0."""
    env = body["env"]
    response = httpx.post(env["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions", timeout=120.0,
                          headers={"Authorization": f"Bearer {env['RELAX_API_KEY']}"},
                          json={"model": env["RELAX_MODEL"], "messages": body["input"]["messages"]})
    if response.status_code != 200:
        return {"exit_code": 1, "output": "", "log": f"model call answered {response.status_code}: {response.text}"}
    return {"exit_code": 0, "output": json.dumps({"reward": 1.0}), "log": "asked the model once\n"}


def failing(code: int, text: str) -> Handler:
    """A handler that answers `code` with log `text` without calling the model."""
    return lambda body, cancelled: {"exit_code": code, "output": "", "log": text}


def hanging(body: dict[str, Any], cancelled: threading.Event) -> dict[str, Any]:
    """Runs until its DELETE (at most a minute), then answers a cancelled exit."""
    cancelled.wait(60.0)
    return {"exit_code": 143, "output": "", "log": "cancelled by DELETE\n"}


class FakeAgentServer:
    """The agent-server contract around `handler`, in a background thread; use as a context manager."""

    def __init__(self, handler: Handler = chat_once) -> None:
        self.handler = handler
        self.received: list[dict[str, Any]] = []
        """Every POST /sessions body, in arrival order."""
        self.deleted: list[str] = []
        """Session ids of every DELETE, in arrival order."""
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.post("/sessions")
        def post(body: dict[str, Any]) -> dict[str, Any]:  # a sync route: FastAPI runs it in a worker thread
            return self._run(body)

        @app.delete("/sessions/{session_id}")
        def delete(session_id: str) -> dict[str, bool]:
            with self._lock:
                self.deleted.append(session_id)
                event = self._cancels.get(session_id)
            if event is not None:
                event.set()
            return {"cancelled": event is not None}

        return app

    def _run(self, body: dict[str, Any]) -> dict[str, Any]:
        cancelled = threading.Event()
        with self._lock:
            self.received.append(body)
            self._cancels[body["session_id"]] = cancelled
        try:
            return self.handler(body, cancelled)
        finally:
            with self._lock:
                self._cancels.pop(body["session_id"], None)

    def __enter__(self) -> FakeAgentServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the fake agent server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            for event in self._cancels.values():
                event.set()
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10.0)


def logged(body: dict[str, Any], cancelled: threading.Event) -> dict[str, Any]:
    """`chat_once`, with one line per session on stdout (the service's log)."""
    print(f"session {body['session_id']} mode {body['env'].get('RELAX_ROLLOUT_MODE')}", flush=True)
    return chat_once(body, cancelled)


def main(argv: list[str] | None = None) -> None:
    """Serve `logged` on 127.0.0.1:`--port` until terminated."""
    parser = argparse.ArgumentParser(description="the fake agent server, in the foreground")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(FakeAgentServer(logged).app(), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
