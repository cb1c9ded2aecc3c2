"""Session traces end to end (tracking/traces.py, stages/traces.py): a real `job=train` step on the tiny model
writes one OTLP JSON trace per session that covers every turn, whose turns and agent gaps add up to the session's
recorded time, joined to the training step and micro-batches that consumed its tokens; a turn preempted under
`runtime=partial` shows its abort and resume; `tracking.traces=false` writes nothing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run
from relax_pipeline.testing.engines import register_paced

TOLERANCE_NS = 3_000_000
"""A few milliseconds: a turn's commit after its last engine call, clock reads between stages."""


def train_config(out: Path, tiny_path: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "job=train", f"output_dir={out}", f"model.cache_dir={tiny_path.parent}", "rollout.num_steps=1",
            "rollout.batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=8",
            "trainer.batching.micro_batch_size=2", f"debug.save_rollout_data={out}/dump/r_{{rollout_id}}.jsonl",
            *overrides,
        ]))


def spans_of(line: str) -> list[dict]:
    request = json.loads(line)
    (resource,) = request["resourceSpans"]
    (scope,) = resource["scopeSpans"]
    assert scope["scope"]["name"] == "relax_pipeline"
    return scope["spans"]


def attrs(span: dict) -> dict:
    """The span's attributes as Python values (OTLP JSON writes an `intValue` as a decimal string)."""
    values = {a["key"]: next(iter(a["value"].items())) for a in span["attributes"]}
    return {key: int(value) if kind == "intValue" else value for key, (kind, value) in values.items()}


def duration(span: dict) -> int:
    return int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])


def test_each_session_has_one_trace_covering_its_turns_and_joined_to_its_training_step(
        tmp_path: Path, tiny_path: Path) -> None:
    run(train_config(tmp_path, tiny_path))
    rows = {r["session_id"]: r for r in map(json.loads, (tmp_path / "dump" / "r_0.jsonl").read_text().splitlines())}
    lines = (tmp_path / "traces" / "step_0.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) == 4, "one line per session"
    for line in lines:
        spans = spans_of(line)
        _check_ids_and_attributes(spans)
        root = next(s for s in spans if s["name"] == "session")
        row = rows[attrs(root)["relax.session_id"]]
        by_parent = _children(spans)
        top = by_parent[root["spanId"]]
        turns = [s for s in top if s["name"] == "turn"]
        assert [attrs(t)["relax.turn"] for t in turns] == list(range(row["turn_count"])), "every turn"
        assert sum(attrs(t)["relax.completion_tokens"] for t in turns) == sum(row["loss_mask"])
        assert all(attrs(t)["relax.weight_version"] == 0 and attrs(t)["relax.prompt_tokens"] > 0 for t in turns)
        _check_turns(turns, by_parent, row)
        gaps = [s for s in top if s["name"] == "agent_gap"]
        recorded = round((row["timing"]["exited"] - row["timing"]["created"]) * 1e9)
        assert abs(sum(map(duration, turns + gaps)) - recorded) < TOLERANCE_NS, "turns + gaps = the session's time"
        names = Counter(s["name"] for s in top)
        assert names["export"] == names["reward"] == names["credit"] == names["train_step"] == 1
        (train,) = (s for s in top if s["name"] == "train_step")
        batches = by_parent[train["spanId"]]
        assert batches and {b["name"] for b in batches} == {"micro_batch"}
        assert all(attrs(b)["relax.samples"] >= 1 for b in batches)
        assert int(root["endTimeUnixNano"]) >= int(train["endTimeUnixNano"])


def _check_ids_and_attributes(spans: list[dict]) -> None:
    assert len({s["traceId"] for s in spans}) == 1 and len(spans[0]["traceId"]) == 32
    assert len({s["spanId"] for s in spans}) == len(spans) and all(len(s["spanId"]) == 16 for s in spans)
    assert [s for s in spans if "parentSpanId" not in s] == [spans[0]], "one root, listed first"
    step = {attrs(s)["relax.step"] for s in spans}
    assert step == {0} and len({attrs(s)["relax.session_id"] for s in spans}) == 1
    assert all(isinstance(s["startTimeUnixNano"], str) and int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"])
               for s in spans)


def _children(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for span in spans:
        out.setdefault(span.get("parentSpanId", ""), []).append(span)
    return out


def _check_turns(turns: list[dict], by_parent: dict[str, list[dict]], row: dict) -> None:
    """queue, prefill and decode of each turn add up to it; they match the dump's per-turn timing."""
    for turn, timing in zip(turns, row["timing"]["turns"], strict=True):
        parts = by_parent[turn["spanId"]]
        assert [p["name"] for p in parts] == ["queue", "prefill", "decode"], "the embedded engine says its first token"
        assert abs(sum(map(duration, parts)) - duration(turn)) < TOLERANCE_NS
        assert duration(turn) == pytest.approx(timing["total_ms"] * 1e6, abs=1e4)


def test_tracing_off_writes_nothing(tmp_path: Path, tiny_path: Path) -> None:
    run(train_config(tmp_path, tiny_path, "tracking.traces=false"))
    assert (tmp_path / "dump" / "r_0.jsonl").exists() and not (tmp_path / "traces").exists()


def test_a_preempted_turn_shows_its_abort_and_resume(tmp_path: Path, tiny_path: Path) -> None:
    """runtime=partial: the long session's generation is aborted at step 0's close and resumed in step 1; its turn
    has queue, decode (the paced engine gives no first-token time), abort (parked) and resume spans."""
    register()
    register_paced()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"task {i}", "metadata": {"max_tokens": m, "turns": 1}}) + "\n"
                            for i, m in enumerate((120, 300, 900))))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=rollout", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=false", "agent=long_tail", "engine=paced", "rollout.max_response_len=1000",
            "rollout.max_context_len=4096", "runtime=partial", "rollout.num_steps=2", "rollout.batch_size=1",
            "rollout.over_sampling_batch_size=2", "rollout.n_samples_per_prompt=1", "engine.token_s=0.005",
            "engine.mean_tokens=5000", "engine.sigma=0.01", "runtime.max_aborted_count=2"]))
    run(cfg)
    traces = [spans_of(line) for step in (0, 1) for line in (tmp_path / "traces" / f"step_{step}.jsonl")
              .read_text().splitlines()]
    resumed = [spans for spans in traces if any(s["name"] == "resume" for s in spans)]
    assert len(resumed) == 1, [sorted({s["name"] for s in spans}) for spans in traces]
    spans = resumed[0]
    (turn,) = (s for s in spans if s["name"] == "turn")
    parts = _children(spans)[turn["spanId"]]
    assert [p["name"] for p in parts] == ["queue", "decode", "abort", "resume"]
    assert attrs(parts[1])["relax.prefill_included"] is True and attrs(turn)["relax.aborts"] == 1
    assert abs(sum(map(duration, parts)) - duration(turn)) < TOLERANCE_NS
    assert [c["name"] for c in _children(spans)[parts[3]["spanId"]]] == ["decode"]
