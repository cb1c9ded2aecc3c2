"""`tracking.otlp_endpoint`: the session traces reach a real OTLP/HTTP receiver (a tiny `http.server` on
127.0.0.1:0 that decodes what the SDK's exporter posts) with the same trace and span ids as the JSON file."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from relax_pipeline.tracking.traces import SpanRecord, TraceWriter, trace_file

START = 1_700_000_000_000_000_000


class Receiver(BaseHTTPRequestHandler):
    """Keeps every POST to /v1/traces, decoded; answers 200 with an empty ExportTraceServiceResponse."""

    received: list[tuple[str, ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        Receiver.received.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Receiver.received = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def session(index: int) -> SpanRecord:
    base = {"relax.session_id": f"sess-{index}", "relax.step": 7}
    turn = SpanRecord("turn", START + 10, START + 50, {**base, "relax.turn": 0},
                      (SpanRecord("queue", START + 10, START + 20, base),
                       SpanRecord("decode", START + 20, START + 50, base)))
    return SpanRecord("session", START, START + 100, base, (turn,))


def test_traces_reach_an_otlp_http_endpoint_with_the_files_ids(tmp_path: Path, receiver: str) -> None:
    writer = TraceWriter(tmp_path, endpoint=receiver)
    writer.submit(7, [session(0), session(1)])
    writer.close()
    ((path, request),) = Receiver.received
    assert path == "/v1/traces", "the traces path is added to an endpoint given without one"
    spans = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
    assert sorted(s.name for s in spans) == sorted(["session", "turn", "queue", "decode"] * 2)
    assert {s.start_time_unix_nano for s in spans if s.name == "session"} == {START}
    in_file = [json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
               for line in trace_file(tmp_path, 7).read_text().splitlines()]
    assert {(s["traceId"], s["spanId"]) for line in in_file for s in line} == {
        (s.trace_id.hex(), s.span_id.hex()) for s in spans}
