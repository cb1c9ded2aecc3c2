"""Session traces without a run: `stages/traces.py` lays out known times (a preempted and resumed turn, agent gaps,
the stage marks) and `tracking/traces.py` writes them as OTLP JSON, or writes nothing when tracing is off."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from relax_pipeline.data.dataset import Prompt
from relax_pipeline.forest.store import GenerationPiece, Node, TurnTiming
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.traces import session_trace
from relax_pipeline.tracking.traces import SpanRecord, TraceWriter, any_value, trace_file
from relax_pipeline.turn.sessions import ForestStore

T0 = 1_700_000_000.0
MS = 1_000_000


def _session_with_turns():  # noqa: ANN202 - (group, session)
    """A session created at T0, exiting at T0 + 1 s, with two turns: the second preempted once and resumed."""
    store = ForestStore()
    session = store.open("g", 0, 3, "train", {})
    session.timing.update(created=T0, exited=T0 + 1.0, exported=T0 + 1.002, scoring=T0 + 1.010, scored=T0 + 1.030,
                          credited=T0 + 1.031)
    first = TurnTiming(5.0, 95.0, 100.0, T0 + 0.1, (GenerationPiece(5.0, 100.0, 25.0),))
    second = TurnTiming(50.0, 250.0, 300.0, T0 + 0.5,
                        (GenerationPiece(0.0, 100.0, 10.0), GenerationPiece(150.0, 300.0, 160.0)))
    nodes = [Node(0, None, "root", (), array("i"), b"", 0), Node(1, 0, "observation", (), array("i", [1] * 20), b"", 1),
             Node(2, 1, "response", (), array("i", [2] * 7), b"", 2, weight_versions=array("i", [4] * 7),
                  finish_reason="stop", timing=first),
             Node(3, 2, "observation", (), array("i", [1] * 5), b"", 3),
             Node(4, 3, "response", (), array("i", [2] * 9), b"", 4, weight_versions=array("i", [4] * 4 + [5] * 5),
                  finish_reason="stop", abort_count=1, timing=second)]
    session.forest.nodes.extend(nodes)
    return Group("g", Prompt(0, "task"), 3, "train", Path("."), [session]), session


def _by_name(root: SpanRecord) -> dict[str, list[SpanRecord]]:
    out: dict[str, list[SpanRecord]] = {}
    for span in root.walk():
        out.setdefault(span.name, []).append(span)
    return out


def test_a_sessions_turns_gaps_and_stages_are_laid_out_from_its_recorded_times() -> None:
    group, session = _session_with_turns()
    root = session_trace(group, session, step=3)
    spans = _by_name(root)
    first, second = spans["turn"]
    assert (first.start_ns, first.end_ns) == (round(T0 * 1e9) + 100 * MS, round(T0 * 1e9) + 200 * MS)
    assert dict(second.attributes).items() >= {"relax.turn": 1, "relax.prompt_tokens": 32, "relax.completion_tokens": 9,
                                       "relax.weight_version": 5, "relax.first_weight_version": 4}.items()
    assert [c.name for c in first.children] == ["queue", "prefill", "decode"]
    assert [c.name for c in second.children] == ["queue", "prefill", "decode", "abort", "resume"]
    abort, resume = second.children[3:]
    assert (abort.end_ns - abort.start_ns, resume.end_ns - resume.start_ns) == (50 * MS, 150 * MS)
    assert [(c.name, c.end_ns - c.start_ns) for c in resume.children] == [("prefill", 10 * MS), ("decode", 140 * MS)]
    turns_and_gaps = spans["turn"] + spans["agent_gap"]
    assert sum(s.end_ns - s.start_ns for s in turns_and_gaps) == 1000 * MS, "they tile [created, exited]"
    assert [s.end_ns - s.start_ns for s in spans["agent_gap"]] == [100 * MS, 300 * MS, 200 * MS]
    # epoch seconds as floats: the marks are exact to about 0.2 us
    assert [(s.name, round((s.end_ns - s.start_ns) / MS, 3)) for s in root.children[-3:]] == [
        ("export", 2.0), ("reward", 20.0), ("credit", 1.0)]
    assert all(s.attributes["relax.session_id"] == session.id and s.attributes["relax.step"] == 3
               for s in root.walk())
    assert "train_step" not in spans, "no training step was given"


def test_the_writer_writes_one_otlp_json_request_per_session(tmp_path: Path) -> None:
    group, session = _session_with_turns()
    roots = [session_trace(group, session, step=3)] * 2
    writer = TraceWriter(tmp_path)
    writer.submit(3, roots)
    writer.close()
    lines = trace_file(tmp_path, 3).read_text().splitlines()
    assert len(lines) == 2
    first, second = ([s for r in json.loads(line)["resourceSpans"] for sc in r["scopeSpans"] for s in sc["spans"]]
                     for line in lines)
    assert len(first) == len(roots[0].walk()) and first[0]["name"] == "session" and "parentSpanId" not in first[0]
    assert first[0]["traceId"] != second[0]["traceId"], "one trace per session"
    ids = {s["spanId"] for s in first}
    assert all(s["parentSpanId"] in ids for s in first[1:]) and int(first[0]["traceId"], 16) > 0
    assert first[0]["startTimeUnixNano"] == str(round(T0 * 1e9)) and first[1]["kind"] == 1


def test_tracing_off_writes_nothing(tmp_path: Path) -> None:
    group, session = _session_with_turns()
    writer = TraceWriter(tmp_path, enabled=False)
    writer.submit(0, [session_trace(group, session, step=0)])
    assert writer.write(0, [session_trace(group, session, step=0)]) is None
    writer.close()
    assert not (tmp_path / "traces").exists()


def test_attribute_values_use_the_otlp_json_encoding() -> None:
    assert any_value(3) == {"intValue": "3"} and any_value(True) == {"boolValue": True}
    assert any_value(0.5) == {"doubleValue": 0.5} and any_value("x") == {"stringValue": "x"}
    assert any_value([1, 2]) == {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "2"}]}}
