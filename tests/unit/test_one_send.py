"""`gateway/server.py` `OneSend`: a connection's writes in one loop step leave as one send, in order, and
nothing held is lost when the connection closes (over real HTTP: tests/integration/test_gateway_one_send.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from relax_pipeline.gateway.server import OneSend


class Recorder:
    """A transport that records what it is asked to send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return f"info:{name}"


def test_writes_of_one_step_leave_together() -> None:
    async def go() -> Recorder:
        transport = Recorder()
        one = OneSend(transport)  # type: ignore[arg-type]
        one.write(b"HTTP/1.1 200 OK\r\n\r\n")
        one.write(b"body")
        assert transport.sent == []
        await asyncio.sleep(0)
        one.write(b"next")
        await asyncio.sleep(0)
        assert one.get_extra_info("peername") == "info:peername"
        return transport

    assert asyncio.run(go()).sent == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"next"]


def test_close_sends_what_is_held_first() -> None:
    async def go() -> Recorder:
        transport = Recorder()
        one = OneSend(transport)  # type: ignore[arg-type]
        one.write(b"last words")
        one.close()
        await asyncio.sleep(0)
        return transport

    transport = asyncio.run(go())
    assert transport.sent == [b"last words"] and transport.closed
