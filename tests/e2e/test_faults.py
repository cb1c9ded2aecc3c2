"""Fault injection in whole runs (`run(cfg)`, real gateway, real subprocess agents, scripted engine): each fault
ends its session as a recorded drop with the reason, its group is replaced within the step, and the run
goes on. After every run, each session that started (wrote its input file) has a row in the dump: none lost.

Faults: an agent SIGKILLed while its request is being generated; an agent that exits 0 without a model
call or an output file; the engine raising mid-generation; a group reward model and an advantage hook
that raise or return the wrong shape; a full disk when the dump is written. The agent is
`tests/agents/fault_agent.py`; the engine is `testing/faults.py`'s `FaultyScriptEngine`; the user functions
are `tests/fault_hooks.py`. Gateway-level faults (a client leaving mid-stream, a closed session) are in
`tests/integration/test_gateway_faults.py`.
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
from relax_pipeline.tracking import dump as dump_module
from relax_pipeline.tracking.dump import DumpWriteError

FAULT_AGENT = REPO_ROOT / "tests" / "agents" / "fault_agent.py"
SCRIPT = [{"content": "The answer is 5."}]


def faulty_run(tmp_path: Path, tiny_path: Path, fault: str, *extra: str) -> tuple[dict, list[dict]]:
    """One rollout step (4 groups of 2) with the fault agent and the faulty scripted engine; metrics and rows."""
    script = tmp_path / "script.jsonl"
    script.write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    cfg = compose_config(tmp_path, tiny_path, "engine=scripted", f"engine.script={script}",
                         "engine._target_=relax_pipeline.testing.faults.FaultyScriptEngine",
                         f"agent.command='{sys.executable} {FAULT_AGENT}'", f"+agent.env.FAULT={fault}",
                         "rollout.batch_size=4", *extra)
    metrics = run(cfg)
    return metrics, read_dump(tmp_path / "dump" / "r_0.jsonl")


def assert_no_session_lost(tmp_path: Path, rows: list[dict]) -> int:
    """Every session that started has a dump row (samples, or a failed/dropped row with its reason)."""
    started = set()
    for path in tmp_path.rglob("input.json"):
        group_id, index = path.parent.name.rsplit("-", 1)
        started.add((group_id, int(index)))
    recorded = {(r["group_id"], r["index"]) for r in rows}
    assert started and started <= recorded, f"sessions without a row: {sorted(started - recorded)}"
    for row in rows:
        assert (row["error"] is None) == (row["status"] in ("completed", "truncated", "filtered")), row["status"]
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
    assert failed and all("killed by signal SIGKILL" in r["error"] for r in failed)
    assert all(r["turn_count"] == 0 for r in failed), "the aborted turn was not committed"
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)
    assert "status=499" in (tmp_path / "run.log").read_text(), "the gateway saw the client go mid-generation"


def test_an_agent_that_exits_0_without_a_call_or_output_fails_its_session(tmp_path: Path, tiny_path: Path) -> None:
    _, rows = faulty_run(tmp_path, tiny_path, "silent")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("made no model call" in r["error"] for r in failed)
    assert_replaced(rows)
    assert_no_session_lost(tmp_path, rows)


def test_the_engine_raising_mid_generation_fails_that_session_only(tmp_path: Path, tiny_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTY_ENGINE_FAIL_EVERY", "3")
    monkeypatch.setenv("FAULTY_ENGINE_MAX_FAILURES", "4")  # at most 4 groups dropped: 16 starts always suffice
    _, rows = faulty_run(tmp_path, tiny_path, "none")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all("HTTP Error 500" in r["error"] for r in failed), \
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
