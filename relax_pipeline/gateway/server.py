"""Gateway server lifecycle: uvicorn inside the run's event loop, on 127.0.0.1 and a free port.

`GatewayServer.start()` binds port 0 (or a configured port), waits until uvicorn accepts connections
and exposes `base_url`, the agents' `RELAX_BASE_URL` (service path included, trailing `/`).
`stop()` shuts it down. It shares the event loop with the pipeline, so no thread hop sits on the
request path; the engine's compute runs in its own worker thread.

The listening socket is created with `IPPROTO_TCP`, so asyncio sets TCP_NODELAY on every accepted
connection (it does so only for sockets whose protocol is TCP, and an accepted socket inherits the
listener's). With protocol 0, uvicorn's separate header and body writes left the body waiting for the
client's delayed ACK: about 40 ms per keep-alive request instead of about 1 ms. This module does not
pick the event loop (the run's `asyncio.run` loop serves) and serves IPv4 hosts only.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from starlette.types import ASGIApp


class GatewayServer:
    """One uvicorn server for one run."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, prefix: str = "/agentic_api") -> None:
        self.app = app
        self.host = host
        self.port = port
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30, backlog=2048)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}/"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = None
