"""Gateway server lifecycle: uvicorn inside the run's event loop, on `gateway.host`:`gateway.port`.

`GatewayServer.start()` binds the configured host and port (port 0: a free one), waits until uvicorn
accepts connections and exposes `base_url`, the agents' `RELAX_BASE_URL` (service path included, trailing
`/`): `gateway.public_url` when set (what agents on other hosts reach: a DNS name, a proxy, a tunnel), else
derived from the bound address (a wildcard bind, `0.0.0.0` or `::`, advertises this machine's primary
address). `stop()` shuts it down. It shares the event loop with the pipeline, so no thread hop sits on
the request path; the engine's compute runs in its own worker thread.

Binding anything but a loopback address opens the gateway to other hosts, so `check_bind` refuses it
unless `gateway.allow_remote=true` (the app then takes only each session's secret key, `RELAX_API_KEY`;
see `gateway/app.py`). `check_public_url` refuses a public URL that drops the service prefix or the
trailing `/`. Both live with the `gateway` node's record (`gateway/settings.py`), which runs them at start-up,
and the constructor runs them again; `GatewayServer.of` builds the server of a `gateway` node.

The listening socket is created with `IPPROTO_TCP`, so asyncio sets TCP_NODELAY on every accepted
connection (it does so only for sockets whose protocol is TCP, and an accepted socket inherits the
listener's). With protocol 0, uvicorn's separate header and body writes left the body waiting for the
client's delayed ACK on every keep-alive request. With NODELAY on, uvicorn's two writes were two segments and two
wake-ups of the client, so a response's head waits for its body and both leave as one send (`OneSend`); what each
cost is on docs/benchmarks.md ("Gateway").
uvicorn's proxy-header middleware (`FORWARDED_ALLOW_IPS`) wraps everything but the model turns (`proxied`), which
read neither the client address nor the scheme it rewrites.
This module does not pick the event loop (the run's `asyncio.run` loop serves), does not terminate TLS (put a
proxy in front and name it in `gateway.public_url`) and does not authenticate (the app does). Nor does it handle
signals: uvicorn's own SIGINT/SIGTERM handlers are left out (`_Server`), so a Ctrl-C reaches the run's stop path
(which drops the running groups first) instead of closing the gateway under the agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from relax_pipeline.gateway.app import GatewayApp
from relax_pipeline.gateway.settings import WILDCARD_HOSTS, GatewaySettings, check_bind, check_public_url

_PROBE = ("198.51.100.1", 9)
"""A documentation address (TEST-NET-2): connecting a UDP socket to it picks the source address of the
default route without sending a packet."""


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the run's (`run.StopSignals`) keep SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One uvicorn server for one run, on `host`:`port`, advertising `base_url`."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, prefix: str = "/agentic_api",
                 public_url: str | None = None, allow_remote: bool = False) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        check_bind(host, port, allow_remote)
        if public_url is not None:
            check_public_url(public_url, self.prefix)
        self.public_url = public_url
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, app: ASGIApp, settings: GatewaySettings, prefix: str) -> GatewayServer:
        """The server of a `gateway` node (`prefix`: `protocol.service_prefix`)."""
        return cls(app, settings.host, settings.port, prefix, settings.public_url, settings.allow_remote)

    async def start(self) -> None:
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=30, backlog=2048, http=http_protocol(), proxy_headers=False)
        config.app = proxied(self.app, config.forwarded_allow_ips)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    @property
    def bound_url(self) -> str:
        """Where the server listens, with the service path (`http://0.0.0.0:PORT/agentic_api/` on a wildcard)."""
        return f"http://{url_host(self.host)}:{self.port}{self.prefix}/"

    @property
    def base_url(self) -> str:
        """What agents use (`RELAX_BASE_URL`): `public_url`, else the bound address (a wildcard bind names
        this machine's primary address)."""
        if self.public_url is not None:
            return self.public_url
        host = machine_address(self.host) if self.host in WILDCARD_HOSTS else self.host
        return f"http://{url_host(host)}:{self.port}{self.prefix}/"

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._server = None


def proxied(app: ASGIApp, trusted_hosts: list[str] | str) -> ASGIApp:
    """`app` behind uvicorn's proxy-header middleware (a trusted host's `X-Forwarded-For`/`-Proto` become the client
    and the scheme) everywhere but on a `GatewayApp`'s model turns, which read neither: one middleware call and one
    header scan less per turn."""
    if isinstance(app, GatewayApp):
        return GatewayApp(ProxyHeadersMiddleware(app.fallback, trusted_hosts=trusted_hosts), app.routes)
    return ProxyHeadersMiddleware(app, trusted_hosts=trusted_hosts)


def http_protocol() -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol sending each response's head with its body (`OneSend`); uvicorn's own choice
    ("auto") where httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class OneSendHttp(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(OneSend(transport))  # type: ignore[arg-type]

        def on_response_complete(self) -> None:
            self.transport.next_response()  # type: ignore[attr-defined]
            super().on_response_complete()

    return OneSendHttp


class OneSend:
    """A connection's transport that holds a response's head until its first body bytes and sends them as one.

    uvicorn writes a response's head and body separately; with TCP_NODELAY each is its own segment and its own
    wake-up of the client, which then reads a head without its body. Only the head waits (a streamed body's
    chunks, SSE heartbeats included, leave as they come); a head still held leaves when the response completes
    or the connection closes, and an interim `100 Continue` is never held.
    """

    __slots__ = ("_held", "_hold", "_transport")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._hold = True
        """The next write is a response's head."""

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif self._hold and not data.startswith(b"HTTP/1.1 100 "):
            self._held, self._hold = data, False
            return
        self._transport.write(data)  # type: ignore[attr-defined]

    def next_response(self) -> None:
        """The response is complete: send what is held; the next write is the next response's head."""
        self._flush()
        self._hold = True

    def _flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (IPv4 or IPv6 as the host says); errors name `gateway.host/port`."""
    try:
        family, _, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    except OSError as error:
        raise ValueError(f"gateway.host={host!r} does not resolve ({error}); use an address of this machine, "
                         "127.0.0.1, or 0.0.0.0") from None
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ValueError(f"gateway.host={host!r} gateway.port={port}: cannot bind ({error.strerror}); choose a free "
                         "port (gateway.port=0 picks one) and an address of this machine") from None
    sock.listen(2048)
    return sock


def machine_address(host: str = "0.0.0.0") -> str:
    """This machine's primary address of `host`'s family (the default route's source), else loopback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = ("2001:db8::1", 9) if family == socket.AF_INET6 else _PROBE
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect(probe)
            address = str(udp.getsockname()[0])
    except OSError:
        address = ""
    if not address or ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return "::1" if family == socket.AF_INET6 else "127.0.0.1"
    return address


def url_host(host: str) -> str:
    """`host` as it appears in a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
