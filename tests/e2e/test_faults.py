"""Fault injection in whole runs (`run(cfg)`, real gateway, real subprocess agents, scripted engine): each fault
ends its session as a recorded drop with the reason, its group is replaced within the step, and the run
goes on. After every run, each session that started (wrote its input file) has a row in the dump: none lost.

Faults: an agent SIGKILLed while its request is being generated; an agent that exits 0 without a model
call or an output file; the engine raising mid-generation; a group reward model and an advantage hook
that raise or return the wrong shape; a full disk when the dump is written; an agent that fails (exit 3, or
hangs until `agent.timeout`) after a turn cut on `length`, by its own `max_tokens` or by the pipeline's budget.
Every row's `outcome` is checked against its status, and the step's `rollout/outcome/<name>` counts against the
rows. The agents are `tests/agents/fault_agent.py` and `cut_then_fail.py`; the engine is `testing/faults.py`'s
`FaultyScriptEngine`; the user functions are `tests/fault_hooks.py`. The outcome `interrupted` is produced by
`tests/e2e/test_terminal_interrupt.py` (a Ctrl-C through the CLI). Gateway-level faults (a client leaving mid-stream, a
closed session) are in `tests/integration/test_gateway_faults.py`.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import fault_hooks
import pytest
from test_e2e_rollout import check_row, compose_config, read_dump

from relax_pipeline.config import REPO_ROOT
from relax_pipeline.run import run
from relax_pipeline.stages.group import OUTCOMES
from relax_pipeline.tracking import dump as dump_module
from relax_pipeline.tracking.dump import DumpWriteError

FAULT_AGENT = REPO_ROOT / "tests" / "agents" / "fault_agent.py"
CUT_AGENT = REPO_ROOT / "tests" / "agents" / "cut_then_fail.py"
SCRIPT = [{"content": "The answer is 5."}]


OUTCOMES_OF = {"completed": {"completed"}, "truncated": {"truncated"}, "filtered": {"filtered"},
               "failed": {"agent_error", "timeout", "infra_error", "reward_error"},
               "dropped": {"sibling_failed", "aborted", "interrupted", "reward_error", "infra_error"}}
"""The outcomes a row of each status may have."""


def faulty_run(tmp_path: Path, tiny_path: Path, fault: str, *extra: str,
               agent: Path = FAULT_AGENT) -> tuple[dict, list[dict]]:
    """One rollout step (4 groups of 2) with the fault agent and the faulty scripted engine; metrics and rows."""
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    cfg = compose_config(tmp_path, tiny_path, "engine=scripted", f"engine.script={script}",
                         "engine._target_=relax_pipeline.testing.faults.FaultyScriptEngine",
                         f"agent.command='{sys.executable} {agent}'", f"+agent.env.FAULT={fault}",
                         "rollout.batch_size=4", *extra)
    metrics = run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    check_outcomes(metrics, rows)
    return metrics, rows


def check_outcomes(metrics: dict, rows: list[dict]) -> None:
    """Each session has one outcome that fits its status; the step's counts are the sessions' outcomes."""
    sessions: dict[tuple[str, int], str] = {}
    for row in rows:
        assert row["outcome"] in OUTCOMES_OF[row["status"]], (row["status"], row["outcome"], row["error"])
        assert (row["outcome"] == "aborted") == (row["error"] or "").startswith("surplus"), row["error"]
        assert sessions.setdefault((row["group_id"], row["index"]), row["outcome"]) == row["outcome"]
    counts = {name: sum(o == name for o in sessions.values()) for name in OUTCOMES}
    assert {name: metrics[f"rollout/outcome/{name}"] for name in OUTCOMES} == counts
    print("outcomes:", {name: n for name, n in counts.items() if n})


def assert_no_session_lost(tmp_path: Path, rows: list[dict]) -> int:
    """Every session that started has a dump row (samples, or a failed/dropped row with its reason)."""
    started = set()
    for path in tmp_path.rglob("input.json"):
        group_id, index = path.parent.name.rsplit("-", 1)
        started.add((group_id, int(index)))
    recorded = {(r["group_id"], r["index"]) for r in rows}
    assert started and started <= recorded, f"sessions without a row: {sorted(started - recorded)}"
    for row in rows:  # a truncated row keeps the failure of an agent that failed after its cut turn
        if row["status"] != "truncated":
            assert (row["error"] is None) == (row["status"] in ("completed", "filtered")), row["status"]
    ended = {status: sum(r["status"] == status for r in rows) for status in ("completed", "failed", "dropped")}
    print(f"faults: {len(started)} sessions started, {ended}, 0 lost")
    return len(started)


def assert_replaced(rows: list[dict], groups: int = 4) -> None:
    """The step still has `groups` complete groups: the broken ones were replaced."""
    done = {r["group_id"] for r in rows if r["status"] in ("completed", "truncated")}
    assert len(done) == groups
    for row in rows:
        if row["status"] in ("completed", "truncated"):
            check_row(row)


def test_an_agent_killed_mid_turn_is_recorded_and_replaced(tmp_path: Path, tiny_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTY_ENGINE_DELAY_S", "1.0")
    _, rows = faulty_run(tmp_path, tiny_path, "kill")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("killed by signal SIGKILL" in r["error"] and r["outcome"] == "agent_error" for r in failed)
    assert len(by_outcome(rows, "sibling_failed")) == len(failed), "its group is dropped whole"
    assert all(r["turn_count"] == 0 for r in failed), "the aborted turn was not committed"
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)
    assert "status=499" in (tmp_path / "run.log").read_text(), "the gateway saw the client go mid-generation"


def test_an_agent_that_exits_0_without_a_call_or_output_fails_its_session(tmp_path: Path, tiny_path: Path) -> None:
    _, rows = faulty_run(tmp_path, tiny_path, "silent")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("made no model call" in r["error"] and r["outcome"] == "agent_error" for r in failed)
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_the_engine_raising_mid_generation_fails_that_session_only(tmp_path: Path, tiny_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTY_ENGINE_FAIL_EVERY", "3")
    monkeypatch.setenv("FAULTY_ENGINE_MAX_FAILURES", "4")  # at most 4 groups dropped: 16 starts always suffice
    _, rows = faulty_run(tmp_path, tiny_path, "none")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("HTTP Error 500" in r["error"] and r["outcome"] == "infra_error" for r in failed), \
        [r["error"] for r in failed]
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)
    assert "injected engine failure" in (tmp_path / "run.log").read_text()


def test_a_reward_model_that_raises_or_miscounts_drops_its_group_and_the_run_goes_on(
        tmp_path: Path, tiny_path: Path) -> None:
    fault_hooks.reset()
    _, rows = faulty_run(tmp_path, tiny_path, "noreward", "credit=group_rm", "credit.rm_path=fault_hooks.group_rm")
    errors = {r["error"] for r in rows if r["status"] == "dropped" and not r["error"].startswith("surplus")}
    assert any("credit.rm_path='fault_hooks.group_rm'" in e and "ZeroDivisionError" in e for e in errors), errors
    assert {r["error"] for r in by_outcome(rows, "reward_error")} == errors
    assert any("returned 3 rewards for 2 samples" in e for e in errors), errors
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_an_advantage_hook_that_raises_or_returns_the_wrong_shape_drops_its_group(tmp_path: Path,
                                                                                  tiny_path: Path) -> None:
    fault_hooks.reset()
    _, rows = faulty_run(tmp_path, tiny_path, "none", "credit=custom_advantage",
                         "credit.advantage_path=fault_hooks.advantage")
    errors = {r["error"] for r in rows if r["status"] == "dropped" and not r["error"].startswith("surplus")}
    assert any("credit.advantage_path='fault_hooks.advantage'" in e and "KeyError" in e for e in errors), errors
    assert any("returned dict for 2 sessions" in e for e in errors), errors
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_a_full_disk_stops_the_run_with_a_clear_error_and_no_half_line(tmp_path: Path, tiny_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def full_disk(fd: int, data: bytes) -> int:
        """Half the bytes reach the file, then the disk is full."""
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dump_module.os, "write", full_disk)
    with pytest.raises(DumpWriteError, match=r"could not write the rollout dump .*r_0.jsonl .*No space left on "
                                             r"device.*the file is unchanged. Free disk space"):
        faulty_run(tmp_path, tiny_path, "none")
    assert (tmp_path / "dump" / "r_0.jsonl").read_bytes() == b""


def by_outcome(rows: list[dict], outcome: str) -> list[dict]:
    return [r for r in rows if r["outcome"] == outcome]


def test_an_agent_failing_after_its_own_max_tokens_cut_is_an_agent_error_not_truncated(tmp_path: Path,
                                                                                       tiny_path: Path) -> None:
    _, rows = faulty_run(tmp_path, tiny_path, "none", "+agent.env.CUT_MAX_TOKENS=4", "+agent.env.CUT_THEN=exit",
                         agent=CUT_AGENT)
    failed = by_outcome(rows, "agent_error")
    assert failed and all(r["status"] == "failed" for r in failed)
    assert all("exited with code 3" in r["error"] and "cut off after 4 tokens" in r["error"] for r in failed)
    assert not by_outcome(rows, "truncated"), "the agent's own max_tokens cut the turn: its failure is its own"
    assert len(by_outcome(rows, "sibling_failed")) == len(failed)
    assert "recorded as truncated" not in (tmp_path / "run.log").read_text()
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_an_agent_that_hangs_after_a_cut_turn_times_out_whoever_cut_it(tmp_path: Path, tiny_path: Path) -> None:
    for name, cut in (("own", "+agent.env.CUT_MAX_TOKENS=4"), ("budget", "rollout.max_response_len=3")):
        out = tmp_path / name
        out.mkdir()
        _, rows = faulty_run(out, tiny_path, "none", cut, "+agent.env.CUT_THEN=hang", "agent.timeout=2",
                             agent=CUT_AGENT)
        timed_out = by_outcome(rows, "timeout")
        assert timed_out and all(r["status"] == "failed" for r in timed_out), name
        assert all("timed out after 2 s of active time" in r["error"] and "cut off after" in r["error"]
                   for r in timed_out), name
        assert not any(r["error"] for r in by_outcome(rows, "truncated")), "a timeout is never truncated"
        assert_no_session_lost(out, rows)


def test_an_agent_failing_after_the_pipelines_budget_cut_is_truncated_with_its_error(tmp_path: Path,
                                                                                      tiny_path: Path) -> None:
    metrics, rows = faulty_run(tmp_path, tiny_path, "none", "rollout.max_response_len=3", "+agent.env.CUT_THEN=exit",
                               agent=CUT_AGENT)
    assert {r["outcome"] for r in rows} == {"truncated"} and metrics["rollout/dropped_groups"] == 0
    failed_after = [r for r in rows if r["error"]]
    assert failed_after, "the '-' prompts' agents exited 3 after the cut"
    assert all("exited with code 3" in r["error"] and "cut off after 3 tokens" in r["error"] for r in failed_after)
    assert metrics["rollout/outcome/truncated"] == len(rows) == 8
    assert "recorded as truncated" in (tmp_path / "run.log").read_text()
    assert_no_session_lost(tmp_path, rows)


def test_a_group_the_filter_rejects_ends_filtered_and_one_the_pipeline_breaks_on_ends_infra_error(
        tmp_path: Path, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_pipeline.stages.runtime import Runtime

    fault_hooks.reset()
    original, calls = Runtime.run, []

    async def breaks_once(self: Runtime, group: object, *rest: object) -> object:
        calls.append(group)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return await original(self, group, *rest)

    monkeypatch.setattr(Runtime, "run", breaks_once)
    metrics, rows = faulty_run(tmp_path, tiny_path, "none", "credit.filter_path=fault_hooks.keep_after_first")
    broken = by_outcome(rows, "infra_error")
    assert len(broken) == 2 and all(r["error"] == "internal error: RuntimeError: boom" for r in broken)
    filtered = by_outcome(rows, "filtered")
    assert len(filtered) == 2 and all(r["status"] == "filtered" for r in filtered)
    assert metrics["rollout/outcome/infra_error"] == metrics["rollout/outcome/filtered"] == 2
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_groups_still_running_when_the_step_has_its_groups_end_aborted(tmp_path: Path, tiny_path: Path) -> None:
    metrics, rows = faulty_run(tmp_path, tiny_path, "none", "rollout.over_sampling_batch_size=6")
    aborted = by_outcome(rows, "aborted")
    assert aborted and all(r["status"] == "dropped" and r["error"].startswith("surplus") for r in aborted)
    assert metrics["rollout/outcome/aborted"] == len(aborted) and metrics["rollout/outcome/completed"] == 8
    assert_no_session_lost(tmp_path, rows)
