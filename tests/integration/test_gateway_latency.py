"""Regression guard for the gateway's delayed-ACK stall: a keep-alive request must not wait ~40 ms.

With a listening socket of protocol 0, asyncio leaves TCP_NODELAY off on accepted connections, and
uvicorn's separate header and body writes make every keep-alive response wait for the client's delayed
ACK (p50 44 ms instead of about 1 ms). These tests run the real `GatewayServer` on 127.0.0.1:0 with the
scripted engine and check the cause (TCP_NODELAY on the server side of an accepted connection) and the
symptom (the median of 50 sequential small requests on one keep-alive connection is far below a stall).
The latency bound is a stall detector, not a speed claim: 10 ms against a 40 ms stall; speed lives in
`bench/gateway.py`.
"""

from __future__ import annotations

import socket
import statistics
import time

import pytest
from test_gateway import Gateway, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.testing.engines import ScriptedEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

REQUESTS = 50
STALL_FREE_MS = 10.0
"""A delayed-ACK stall costs 40 ms or more per request; a healthy loopback request about 1 ms."""


def server_side_sockets(gateway: Gateway) -> list[socket.socket]:
    """The gateway's end of every open connection (uvicorn's per-connection protocols hold the transports)."""
    connections = gateway.server._server.server_state.connections
    return [protocol.transport.get_extra_info("socket") for protocol in connections]


async def sequential_ms(gateway: Gateway, requests: int) -> list[float]:
    """Milliseconds per request for `requests` chat turns sent one after another on one connection."""
    session = gateway.open_session()
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        response = await gateway.post(session, body)
        times.append((time.perf_counter() - start) * 1e3)
        assert response.status_code == 200, response.text
    return times


async def test_accepted_connections_have_tcp_nodelay(template: ChatTemplate, tokenizer) -> None:  # noqa: ANN001
    async with running_gateway(template, ScriptedEngine(tokenizer, ["Hello."])) as gateway:
        assert (await gateway.http.get(gateway.root_url + "/health")).status_code == 200
        sockets = server_side_sockets(gateway)
        assert len(sockets) == 1
        assert sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_keep_alive_requests_do_not_stall(template: ChatTemplate, tokenizer) -> None:  # noqa: ANN001
    async with running_gateway(template, ScriptedEngine(tokenizer, ["Hello."], record_prompts=False)) as gateway:
        await sequential_ms(gateway, 3)
        times = await sequential_ms(gateway, REQUESTS)
        assert len(server_side_sockets(gateway)) == 1, "the client did not keep its connection alive"
    p50 = statistics.median(times)
    assert p50 < STALL_FREE_MS, f"p50 {p50:.1f} ms per request (max {max(times):.1f} ms): a delayed-ACK stall?"
