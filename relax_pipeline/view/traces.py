"""A run's session traces as the viewer reads them: `<output>/traces/step_<n>.jsonl`, one OTLP/JSON line per session.

Each line is an `ExportTraceServiceRequest` (`{"resourceSpans": [{"resource": ..., "scopeSpans": [{"scope": ...,
"spans": [...]}]}]}`) holding one session's spans: `session`, `turn`, `queue`, `prefill`, `decode`, `abort`,
`resume`, `agent_gap`, `export`, `reward`, `credit`, `train_step`, `micro_batch`; every span carries the attributes
`relax.session_id` and `relax.step` (turn spans also `relax.turn` and `relax.weight_version`). Eval sessions are
not traced.

`TraceIndex.find(session_id, step)` returns the session's spans as a timeline: each span with its depth below
the session (from `parentSpanId`), a row (spans of one depth that overlap in time get rows of their own), its
start and end in ms from the trace's first span, and its attributes as plain values. The step's own file is
looked up first, then the later steps' files in order (a session trained in a later step under
`runtime=fully_async` is written there), then the earlier ones, nearest first; an eval dump's session is not
looked up. Each file is indexed once (session id → byte ranges of its lines; the id is found by a pattern
over the line, the line parsed whole only when the pattern misses) and re-indexed when its size or mtime
changed; a torn last line (no newline yet) is skipped until it is complete.

This module only reads; the spans are written by the run's tracing (`tracking.traces`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

TRACES_DIR = "traces"
STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
SESSION_ATTR = re.compile(rb'"relax\.session_id"\s*,\s*"value"\s*:\s*\{\s*"stringValue"\s*:\s*"((?:[^"\\]|\\.)*)"')
NO_TRACE = "no trace recorded (tracking.traces=false?)"


@dataclass(frozen=True)
class TraceFile:
    """One indexed `step_<n>.jsonl`: which sessions it holds and where their lines sit."""

    path: Path
    stamp: tuple[int, float]
    lines: dict[str, list[tuple[int, int]]]
    """Session id → (byte offset, length) of each of its lines."""

    @classmethod
    def build(cls, path: Path) -> TraceFile:
        stat = path.stat()
        data = path.read_bytes()
        lines: dict[str, list[tuple[int, int]]] = {}
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if end > start and (session := _session_of(data[start:end])) is not None:
                lines.setdefault(session, []).append((start, end - start))
            start = end + 1
        return cls(path, (stat.st_size, stat.st_mtime), lines)

    def read(self, session_id: str) -> list[dict[str, Any]]:
        """The OTLP requests of the session's lines, in file order."""
        out = []
        with open(self.path, "rb") as f:
            for offset, length in self.lines.get(session_id, ()):
                f.seek(offset)
                out.append(orjson.loads(f.read(length)))
        return out


def _session_of(line: bytes) -> str | None:
    found = SESSION_ATTR.search(line)
    if found:
        return orjson.loads(b'"' + found.group(1) + b'"')
    try:
        spans = otlp_spans(orjson.loads(line))
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return None
    return next((str(s["attributes"]["relax.session_id"]) for s in spans
                 if "relax.session_id" in s["attributes"]), None)


def attribute_value(value: dict[str, Any]) -> Any:
    """An OTLP `AnyValue` as a plain value (`intValue` is a string in OTLP/JSON)."""
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [attribute_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return {kv["key"]: attribute_value(kv.get("value", {})) for kv in value["kvlistValue"].get("values", [])}
    for key in ("stringValue", "doubleValue", "boolValue", "bytesValue"):
        if key in value:
            return value[key]
    return None


def otlp_spans(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Every span of an `ExportTraceServiceRequest`: ids, name, times in ns and attributes as a dict."""
    out = []
    for resource in request.get("resourceSpans", []):
        for scope in resource.get("scopeSpans", []):
            for span in scope.get("spans", []):
                out.append({"span_id": span.get("spanId", ""), "parent_id": span.get("parentSpanId") or None,
                            "name": span.get("name", ""), "start": int(span.get("startTimeUnixNano", 0)),
                            "end": int(span.get("endTimeUnixNano", 0)),
                            "attributes": {a["key"]: attribute_value(a.get("value", {}))
                                           for a in span.get("attributes", [])}})
    return out


def timeline(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Spans laid out for the page: depth, row, start/end in ms from the first start, sorted by start."""
    by_id = {s["span_id"]: s for s in spans}
    t0 = min(s["start"] for s in spans)
    laid = [{"name": s["name"], "span_id": s["span_id"], "parent_id": s["parent_id"], "depth": _depth(s, by_id),
             "start_ms": (s["start"] - t0) / 1e6, "end_ms": (max(s["end"], s["start"]) - t0) / 1e6,
             "attributes": s["attributes"]} for s in sorted(spans, key=lambda s: (s["start"], -s["end"]))]
    rows = _assign_rows(laid)
    return {"start_unix_nano": str(t0), "duration_ms": max(s["end_ms"] for s in laid), "rows": rows, "spans": laid}


def _depth(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> int:
    depth, seen = 0, {span["span_id"]}
    while (parent := by_id.get(span["parent_id"] or "")) is not None and parent["span_id"] not in seen:
        seen.add(parent["span_id"])
        span, depth = parent, depth + 1
    return depth


def _assign_rows(spans: list[dict[str, Any]]) -> int:
    """Give each span a `row`: depths top to bottom, overlapping spans of one depth on rows of their own."""
    row = 0
    for depth in sorted({s["depth"] for s in spans}):
        ends: list[float] = []
        for span in (s for s in spans if s["depth"] == depth):
            lane = next((i for i, end in enumerate(ends) if end <= span["start_ms"]), len(ends))
            ends[lane: lane + 1] = [span["end_ms"]]
            span["row"] = row + lane
        row += len(ends)
    return row


class TraceIndex:
    """The trace files under `<root>/traces`, indexed lazily and re-indexed when they change."""

    def __init__(self, root: Path) -> None:
        self.folder = Path(root) / TRACES_DIR
        self._files: dict[Path, TraceFile] = {}

    def files(self, first_step: int = 0) -> list[Path]:
        """The step files in search order: `first_step`'s, the later ones by step, then the earlier ones nearest
        first."""
        steps = {int(m.group(1)): p for p in self.folder.glob("step_*.jsonl") if (m := STEP_FILE.search(p.name))}
        return [steps[n] for n in sorted(steps, key=lambda n: (n < first_step, abs(n - first_step)))]

    def _indexed(self, path: Path) -> TraceFile:
        stat = path.stat()
        known = self._files.get(path)
        if known is None or known.stamp != (stat.st_size, stat.st_mtime):
            known = self._files[path] = TraceFile.build(path)
        return known

    def find(self, session_id: str, step: str = "0") -> dict[str, Any] | None:
        """The session's timeline (`timeline`) and the file it came from; None when no trace file holds it or
        `step` is an eval dump's id."""
        if not step.isdigit():
            return None
        for path in self.files(int(step)):
            indexed = self._indexed(path)
            if session_id in indexed.lines:
                spans = [s for request in indexed.read(session_id) for s in otlp_spans(request)]
                if spans:
                    return {"session_id": session_id, "file": str(path.relative_to(self.folder.parent)),
                            **timeline(spans)}
        return None
