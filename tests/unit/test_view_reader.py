"""The run viewer's readers without a server: dump discovery, the paged session index (head-only parsing and
its fallback), the tree rebuilt from a forked session's chains with its fork record, run.log and
metrics.jsonl metrics, and the `MetricsFile` tracker."""

from __future__ import annotations

import json
import random
from pathlib import Path

from relax_pipeline.testing.run_folders import dump_row, write_run_folder
from relax_pipeline.tracking.metrics_file import METRICS_FILE, MetricsFile, read_metrics_file
from relax_pipeline.tracking.tracker import NullTracker, TrackingSettings
from relax_pipeline.view.dump_index import DumpIndex, IndexCache
from relax_pipeline.view.folder import ForkRecord, RunFolder
from relax_pipeline.view.session import build_tree, session_view
from relax_pipeline.view.tokens import TokenText


def test_dumps_are_found_by_the_config_pattern_train_steps_then_evals(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=3, sessions=2)
    (tmp_path / "dump" / "rollout_eval_arith_2.jsonl").write_text("")
    (tmp_path / "dump" / "unrelated.jsonl").write_text("")
    dumps = RunFolder(tmp_path).dump_files()
    assert [(d.id, d.kind) for d in dumps] == [("0", "train"), ("1", "train"), ("2", "train"), ("eval_arith_2", "eval")]


def test_without_a_config_dump_files_are_found_by_their_rows(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=2, sessions=2)
    (tmp_path / "config.yaml").unlink()
    (tmp_path / "notes.jsonl").write_text('{"a": 1}\n')
    assert [d.id for d in RunFolder(tmp_path).dump_files()] == ["0", "1"]


def test_the_index_pages_and_filters_sessions_and_counts_statuses(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=1, sessions=30, fork_every=4, fail_every=10)
    index = DumpIndex.build(tmp_path / "dump" / "rollout_0.jsonl")
    assert len(index.sessions) == 30 and index.rows == 30 + sum(1 for s in range(30) if s % 4 == 2 and s % 10 > 1)
    assert index.counts["failed"] == 3 and index.counts["dropped"] == 3 and index.counts["completed"] == 24
    page = index.page(None, 10, 10)
    assert page["total"] == 30 and [s["session_id"] for s in page["sessions"]] == [f"sess-0-{i}" for i in range(10, 20)]
    failed = index.page("failed", 0, 50)
    assert failed["total"] == 3 and all(s["status"] == "failed" and "code 3" in s["error"] for s in failed["sessions"])
    forked = index.by_id["sess-0-2"].summary()
    assert forked["rows"] == 2 and forked["branches"] == 2 and forked["turns"] == 1
    rows = index.read_rows("sess-0-2")
    assert [r["branch"] for r in rows] == [0, 1] and len(rows[0]["tokens"]) == 36


def test_a_row_whose_head_does_not_parse_alone_is_parsed_whole(tmp_path: Path) -> None:
    row = dump_row(random.Random(0), 0, 0)
    row["metadata"] = {"note": "x", "messages": [1, 2]}  # the head cut lands inside metadata
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    entry = DumpIndex.build(path).sessions[0]
    assert entry.statuses == ["completed"] and entry.rewards == [row["reward"]]


def test_the_cache_rebuilds_an_index_when_its_file_changes(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=1, sessions=4, fork_every=0)
    path, cache = tmp_path / "dump" / "rollout_0.jsonl", IndexCache()
    assert len(cache.get(path).sessions) == 4
    with open(path, "a") as f:
        f.write(json.dumps(dump_row(random.Random(1), 0, 9)) + "\n")
    assert len(cache.get(path).sessions) == 5


def test_the_tree_of_a_forked_session_has_two_branches_and_the_fork_reason() -> None:
    rng = random.Random(0)
    rows = [dump_row(rng, 0, 3, branch=0), dump_row(rng, 0, 3, branch=1)]
    fork = ForkRecord("sess-0-3", 2, "re-sent assistant message 1 differs in content; new branch below node 1", 1)
    nodes = build_tree(rows, [fork])
    question = nodes[nodes[0].children[0]]
    assert question.role == "user" and len(question.children) == 2
    assert question.forks == [f"turn 2: {fork.why}"]
    leaves = [n for n in nodes if n.contexts]
    assert [n.contexts for n in leaves] == [[0], [1]] and [n.text for n in leaves] == ["answer 3", "rewritten 3"]


def test_session_view_carries_tokens_mask_logprobs_and_versions(tmp_path: Path) -> None:
    row = dump_row(random.Random(0), 1, 0, version=1)
    view = session_view("1", [row], [], TokenText(None))
    context = view["contexts"][0]
    assert context["pieces"][:2] == [f"#{row['tokens'][0]}", f"#{row['tokens'][1]}"]
    assert context["loss_mask"] == row["loss_mask"] and context["weight_versions"] == [1] * 24
    assert context["rollout_logprobs"] == row["rollout_logprobs"] and view["tokenizer"].startswith("none")


def test_metrics_come_from_metrics_jsonl_else_from_run_log_lines(tmp_path: Path) -> None:
    write_run_folder(tmp_path, steps=3, sessions=4)
    source, curves = RunFolder(tmp_path).metrics()
    assert source == METRICS_FILE and curves["rollout/raw_reward"] == [(0, 0.0), (1, 1 / 3), (2, 2 / 3)]
    (tmp_path / METRICS_FILE).unlink()
    folder = RunFolder(tmp_path)
    source, curves = folder.metrics()
    assert source == "run.log" and [s for s, _ in curves["rollout/raw_reward"]] == [0, 1, 2]
    with open(tmp_path / "run.log", "a") as f:  # a running run: new lines, a torn last line
        f.write("x INFO relax_pipeline: step 3 metrics rollout/raw_reward=0.9\nx INFO relax_pipeline: step 4 me")
    assert folder.metrics()[1]["rollout/raw_reward"][-1] == (3, 0.9)
    assert folder.forks("sess-0-2")[0].message_index == 1


def test_metrics_file_appends_a_line_per_log_call_and_passes_it_on(tmp_path: Path) -> None:
    tracker = MetricsFile(NullTracker(TrackingSettings()), tmp_path)
    tracker.start({})
    tracker.log({"rollout/raw_reward": 0.5, "train/loss": float("nan")}, 0)
    tracker.log({"eval/arith/raw_reward": 0.25}, 1)
    tracker.finish()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 2, "metr')
    assert read_metrics_file(tmp_path / METRICS_FILE) == [(0, {"rollout/raw_reward": 0.5}),
                                                          (1, {"eval/arith/raw_reward": 0.25})]
