"""The run viewer's readers of session traces (`view/traces.py`) and replay bundles (`view/bundle.py`), without a
server: an OTLP/JSON line per session found by its id across step files, spans laid out by depth with
overlapping spans on rows of their own, attribute values decoded, files re-indexed as they grow (a torn last line
waits), a bundle folder read as a one-step run, and the trained weight version a token's lag is counted from."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from relax_pipeline.replay.format import BundleVersionError
from relax_pipeline.testing.run_folders import step_rows, trace_request, write_bundle, write_run_folder, write_traces
from relax_pipeline.view.folder import RunFolder
from relax_pipeline.view.traces import TraceFile, TraceIndex, attribute_value, otlp_spans, timeline


def test_a_session_s_trace_is_laid_out_by_depth_with_times_from_its_first_span(tmp_path: Path) -> None:
    write_traces(tmp_path, 3, {"a": [3], "b": [2, 3]}, abort_turn=1)
    found = TraceIndex(tmp_path).find("b", "3")
    assert found is not None and found["file"] == "traces/step_3.jsonl" and found["rows"] == 3
    spans = found["spans"]
    turns = [s for s in spans if s["name"] == "turn"]
    assert [(t["start_ms"], t["end_ms"]) for t in turns] == [(0.0, 15.0), (20.0, 40.0)]
    assert [t["attributes"]["relax.weight_version"] for t in turns] == [2, 3]
    named = ("session", "turn", "abort", "micro_batch")
    assert {(s["name"], s["depth"], s["row"]) for s in spans if s["name"] in named} \
        == {("session", 0, 0), ("turn", 1, 1), ("abort", 2, 2), ("micro_batch", 2, 2)}
    session = next(s for s in spans if s["name"] == "session")
    children = [s for s in spans if s["parent_id"] == session["span_id"]]
    assert sum(s["end_ms"] - s["start_ms"] for s in children) == pytest.approx(found["duration_ms"]) == 64
    assert {s["attributes"]["relax.session_id"] for s in spans} == {"b"}


def test_overlapping_spans_of_one_depth_get_rows_of_their_own() -> None:
    request = trace_request("s", 0, [0])
    spans = otlp_spans(request)
    root = spans[0]["span_id"]
    spans += [{**spans[1], "span_id": "x1", "parent_id": root, "name": "reward"},
              {**spans[1], "span_id": "x2", "parent_id": root, "name": "reward"}]
    laid = timeline(spans)
    rows = sorted({s["row"] for s in laid["spans"] if s["depth"] == 1})
    assert rows == [1, 2, 3] and laid["rows"] == 5
    for row in rows:
        same = sorted((s["start_ms"], s["end_ms"]) for s in laid["spans"] if s["row"] == row)
        assert all(a[1] <= b[0] for a, b in zip(same, same[1:], strict=False)), "no overlap within a row"


def test_attribute_values_of_every_otlp_type() -> None:
    assert attribute_value({"intValue": "42"}) == 42 and attribute_value({"doubleValue": 0.5}) == 0.5
    assert attribute_value({"boolValue": True}) is True and attribute_value({"stringValue": "x"}) == "x"
    assert attribute_value({"arrayValue": {"values": [{"intValue": "1"}, {"stringValue": "b"}]}}) == [1, "b"]
    assert attribute_value({"kvlistValue": {"values": [{"key": "k", "value": {"intValue": "2"}}]}}) == {"k": 2}


def test_a_session_is_found_in_another_step_s_file_and_compact_lines_parse(tmp_path: Path) -> None:
    for step in (0, 1, 3, 4):
        write_traces(tmp_path, step, {f"s{step}": [step]})
    folder = tmp_path / "traces"
    (folder / "step_2.jsonl").write_text(json.dumps(trace_request("late", 2, [0]), separators=(",", ":")) + "\n")
    index = TraceIndex(tmp_path)
    assert [p.name[5:-6] for p in index.files(2)] == ["2", "3", "4", "1", "0"], "own step, later ones, earlier ones"
    assert index.find("late", "0")["file"] == "traces/step_2.jsonl"
    assert index.find("nobody", "0") is None and TraceIndex(tmp_path / "nowhere").find("a") is None
    assert index.find("s0", "eval_toy_2") is None, "eval sessions are not traced"


def test_a_file_is_reindexed_as_it_grows_and_a_torn_last_line_waits(tmp_path: Path) -> None:
    path = write_traces(tmp_path, 1, {"a": [1]})
    index = TraceIndex(tmp_path)
    assert index.find("b", "1") is None
    line = json.dumps(trace_request("b", 1, [1]))
    with open(path, "a") as f:
        f.write(line[:100])
    assert index.find("b", "1") is None
    with open(path, "a") as f:
        f.write(line[100:] + "\n")
    assert index.find("b", "1") is not None
    assert set(TraceFile.build(path).lines) == {"a", "b"}


def test_a_bundle_folder_is_a_one_step_run(tmp_path: Path) -> None:
    rows = step_rows(random.Random(0), 4, 4, fork_every=0, fail_every=0, response=6)
    folder = RunFolder(write_bundle(tmp_path / "step_4", 4, rows, {"train/loss": 0.25, "train/weight_version": 5.0}))
    assert folder.bundle is not None and [(d.id, d.path.name) for d in folder.dump_files()] == [("4", "rows.jsonl")]
    assert folder.metrics() == ("metrics.json", {"train/loss": [(4, 0.25)], "train/weight_version": [(4, 5.0)]})
    summary = folder.bundle.summary()
    assert summary["metrics"][0] == ["train/loss", 0.25]
    contexts = [c for g in summary["groups"] for c in g["contexts"]]
    assert [c["advantage"] for c in contexts] == [r["advantage"] for r in rows] and "prompt" not in contexts[0]
    assert folder.trained_version("4") == 4


def test_a_bundle_of_another_format_version_is_refused(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "b", 0, [], {})
    manifest = json.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(BundleVersionError, match="format_version=99"):
        RunFolder(bundle)


def test_the_trained_version_comes_from_the_logged_weight_version(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=2, sessions=2)
    folder = RunFolder(tmp_path)
    assert folder.trained_version("1") == 1 and folder.trained_version("eval_toy_1") is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0, "metrics": {"train/weight_version": 7}})
                                            + "\n")
    assert folder.trained_version("1") == 6
