"""`gateway/server.py` `OneSend`: a response's head leaves with its first body bytes, streamed chunks as they
come, an interim 100 Continue at once, and nothing held is lost when the connection closes (over real HTTP:
tests/integration/test_gateway_one_send.py)."""

from __future__ import annotations

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


def test_head_leaves_with_the_body_and_chunks_as_they_come() -> None:
    transport = Recorder()
    one = OneSend(transport)  # type: ignore[arg-type]
    one.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.sent == []
    one.write(b"first chunk")
    one.write(b"heartbeat")
    one.next_response()
    one.write(b"HTTP/1.1 200 OK\r\n\r\n")
    one.next_response()  # a head-only response (HEAD) leaves when it completes
    assert one.get_extra_info("peername") == "info:peername"
    assert transport.sent == [b"HTTP/1.1 200 OK\r\n\r\nfirst chunk", b"heartbeat", b"HTTP/1.1 200 OK\r\n\r\n"]


def test_continue_is_not_held_and_close_sends_what_is() -> None:
    transport = Recorder()
    one = OneSend(transport)  # type: ignore[arg-type]
    one.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    one.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    one.close()
    assert transport.sent == [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 400 Bad Request\r\n\r\n"]
    assert transport.closed
