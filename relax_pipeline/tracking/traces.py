"""Session traces: one OpenTelemetry trace per session, written as OTLP JSON files (and to an OTLP endpoint).

Format (`tracking.traces=true`, the default): `<output_dir>/traces/step_<n>.jsonl`, one line per session of step
`n`, each line an OTLP/JSON `ExportTraceServiceRequest` holding that session's whole trace:

    {"resourceSpans": [{"resource": {"attributes": [...]},
                        "scopeSpans": [{"scope": {"name": "relax_pipeline"}, "spans": [...]}]}]}

in the OTLP JSON encoding: `traceId` (32) and `spanId`/`parentSpanId` (16) as lowercase hex, `startTimeUnixNano`
and `endTimeUnixNano` as decimal strings, `kind` 1 (internal), attributes as `{"key", "value": AnyValue}`
(`stringValue`, `intValue` as a string, `doubleValue`, `boolValue`, `arrayValue`). Spans are listed parents
first. Every span carries `relax.session_id` and `relax.step`. The span tree (`stages/traces.py` builds it):

    session                          the agent's run: from its start to the end of the step's training
      agent_gap                      the agent's own time before, between and after its model turns
      turn                           one model call (relax.turn, relax.weight_version, relax.prompt_tokens,
        queue                          relax.completion_tokens); queue: waiting for the group's lease
        prefill                        the engine's admission and prefill, to the first token
        decode                         the rest of the generation
        abort                          a preempted generation parked until it resumes (runtime=partial)
        resume                         the resumed generation (its own prefill and decode below it)
      export                         the agent's output read and its exports matched
      reward                         the configured credit's `score`: rewards, then the group's base advantages
      credit                         the group filter and the credit handed to the step (to the end of scoring)
      train_step                     the trainer's `train` call that consumed the session's samples
        micro_batch                    each micro-batch holding one of its samples (relax.optimizer_step,
                                       relax.micro_batch)

The training step is a child span in each session's own trace (same trace id), not a span link: a session's line
is then whole on its own, and the step is joined by `relax.step` (every session of step n shares the numbers and
times of its `train_step`). A session whose group was dropped or filtered has no `train_step`.

Cost: nothing here runs per token or per request. The turn service and the stages already stamp the times a trace
needs (`forest.store.TurnTiming`, `Session.timing`); at the end of a step the stages turn them into `SpanRecord`
trees, and `TraceWriter` makes them OpenTelemetry spans and writes them, in one background thread so the event
loop does not wait for the disk or the collector. The spans are the SDK's finished-span records (`ReadableSpan`,
what its exporters take) made directly with their known times, ids from the SDK's `RandomIdGenerator` and the
SDK's `Resource`: a `Tracer`'s start and end per span (context, sampler, attribute copies) cost about three times
as much and add nothing for spans whose times are already recorded (`bench/gateway.py` prints the cost). With
`tracking.otlp_endpoint` set the same spans also go to that OTLP/HTTP endpoint (the SDK's OTLP exporter, optional
dependency `opentelemetry-exporter-otlp-proto-http`, imported only then). `tracking.traces=false` writes nothing.

What it does not do: trace the gateway's HTTP handling or the engine's batches (no spans are started on the hot
path), or propagate a trace context to agents.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import orjson
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

log = logging.getLogger(__name__)
SCOPE = "relax_pipeline"
TRACES_DIR = "traces"
AttributeValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]


@dataclass(frozen=True)
class SpanRecord:
    """One span of a session's trace as plain times; connects the stages' trace builder (`stages/traces.py`) to
    `TraceWriter`, which makes it an OpenTelemetry span."""

    name: str
    start_ns: int
    """Epoch nanoseconds."""
    end_ns: int
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    children: tuple[SpanRecord, ...] = ()

    def walk(self) -> list[SpanRecord]:
        """This span and every span below it, parents first."""
        return [self, *(s for child in self.children for s in child.walk())]


def trace_file(output_dir: Path | str, step: int) -> Path:
    """Where step `step`'s traces go."""
    return Path(output_dir) / TRACES_DIR / f"step_{step}.jsonl"


class TraceWriter:
    """Writes each step's session traces (`tracking.traces`, `tracking.otlp_endpoint`); see the module."""

    def __init__(self, output_dir: Path | str, enabled: bool = True, endpoint: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self._resource = Resource.create({"service.name": SCOPE})
        self._resource_json = {"attributes": _attributes(self._resource.attributes)}
        self._scope = InstrumentationScope(SCOPE)
        self._ids = RandomIdGenerator()
        self._exporter = otlp_exporter(endpoint) if enabled and endpoint else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="relax-traces")
        self._pending: list[Future[Path | None]] = []

    def submit(self, step: int, sessions: Sequence[SpanRecord]) -> None:
        """Write step `step`'s session traces in the background (nothing when tracing is off or none is given)."""
        if self.enabled and sessions:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._worker.submit(self.write, step, sessions))

    def write(self, step: int, sessions: Sequence[SpanRecord]) -> Path | None:
        """Write step `step`'s session traces now (one line per session) and export them; returns the file."""
        if not self.enabled or not sessions:
            return None
        path = trace_file(self.output_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        exported: list[ReadableSpan] = []
        with path.open("ab") as out:
            for record in sessions:
                spans = self.spans(record)
                out.write(orjson.dumps(self.otlp_json(spans)) + b"\n")
                exported += spans
        if self._exporter is not None:
            self._export(exported)
        return path

    def spans(self, root: SpanRecord) -> list[ReadableSpan]:
        """`root`'s tree as finished SDK spans of one new trace, parents first."""
        spans: list[ReadableSpan] = []
        self._add(root, self._ids.generate_trace_id(), None, spans)
        return spans

    def _add(self, record: SpanRecord, trace_id: int, parent: SpanContext | None, spans: list[ReadableSpan]) -> None:
        context = SpanContext(trace_id, self._ids.generate_span_id(), False, TraceFlags(TraceFlags.SAMPLED))
        spans.append(ReadableSpan(record.name, context, parent, self._resource, record.attributes,
                                  start_time=record.start_ns, end_time=record.end_ns,
                                  instrumentation_scope=self._scope))
        for child in record.children:
            self._add(child, trace_id, context, spans)

    def otlp_json(self, spans: Sequence[ReadableSpan]) -> dict[str, Any]:
        """One `ExportTraceServiceRequest` in OTLP JSON holding `spans` (this writer's resource, one scope)."""
        return {"resourceSpans": [{"resource": self._resource_json,
                                   "scopeSpans": [{"scope": {"name": SCOPE}, "spans": _spans(spans)}]}]}

    def _export(self, spans: list[ReadableSpan]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        assert self._exporter is not None
        if self._exporter.export(spans) is not SpanExportResult.SUCCESS:
            log.warning("tracking.otlp_endpoint: the collector did not take %d spans (see the exporter's log above)",
                        len(spans))

    def flush(self) -> None:
        """Wait for every submitted step; a failure to write is logged, not raised."""
        for future in self._pending:
            try:
                future.result()
            except Exception as error:  # noqa: BLE001 - traces are diagnostics; the run goes on without them
                log.warning("traces: a step's traces could not be written: %s", error)
        self._pending = []

    def close(self) -> None:
        """Flush, stop the worker thread and the exporter."""
        self.flush()
        self._worker.shutdown(wait=True)
        if self._exporter is not None:
            self._exporter.shutdown()


def otlp_exporter(endpoint: str) -> Any:
    """The SDK's OTLP/HTTP span exporter for `endpoint` (`/v1/traces` added when the URL has no path)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        raise ValueError(f"tracking.otlp_endpoint={endpoint!r} needs opentelemetry-exporter-otlp-proto-http; "
                         "install it (pip install 'relax_pipeline[otlp]') or unset the key") from error
    if urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


# --- OTLP JSON encoding ---------------------------------------------------------------------------------------


def _spans(spans: Sequence[ReadableSpan]) -> list[dict[str, Any]]:
    """`spans` in OTLP JSON; an attribute shared by many spans (the session id, the step) is encoded once."""
    encoded: dict[tuple[str, type, Any], dict[str, Any]] = {}
    out = []
    for span in spans:
        context = span.get_span_context()
        assert context is not None
        item: dict[str, Any] = {"traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}"}
        if span.parent is not None:
            item["parentSpanId"] = f"{span.parent.span_id:016x}"
        item.update(name=span.name, kind=span.kind.value + 1, startTimeUnixNano=str(span.start_time),
                    endTimeUnixNano=str(span.end_time), attributes=_attributes(span.attributes or {}, encoded),
                    status={})
        out.append(item)
    return out


def _attributes(attributes: Mapping[str, Any], encoded: dict[tuple[str, type, Any], dict[str, Any]] | None = None
                ) -> list[dict[str, Any]]:
    if encoded is None:
        return [{"key": key, "value": any_value(value)} for key, value in attributes.items()]
    out = []
    for key, value in attributes.items():
        memo = (key, type(value), value if isinstance(value, str | int | float | bool) else id(value))
        if memo not in encoded:
            encoded[memo] = {"key": key, "value": any_value(value)}
        out.append(encoded[memo])
    return out


def any_value(value: Any) -> dict[str, Any]:
    """An attribute value as an OTLP JSON `AnyValue`."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    return {"arrayValue": {"values": [any_value(v) for v in value]}}
