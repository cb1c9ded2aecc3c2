"""Agent-slot capacity table and refusal, the active-time clock across a parked interval, the barrier.

The slot table is checked row by row (`stages/capacity.py`), then through `job=check` and a refused
start. The lease tests run a real agent process group under a real `Runtime` stage: time parked does
not count against `agent.timeout`, expiry ends the whole group and records the session as failed, and a
first-request barrier that waits too long names the missing session.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.agent.launcher import AgentProcess, AgentSpec, _group_alive
from relax_pipeline.config import CONF_DIR, register
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.run import run
from relax_pipeline.stages.capacity import EvalLoad, SlotPlan, check_slots, eval_groups
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.runtime import Runtime
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.leases import GroupLease
from relax_pipeline.turn.sessions import ForestStore, Status

T = 4 * 2  # 4 resident groups of 2 sessions


@pytest.mark.parametrize(("evals", "retains", "required"), [
    ((), False, T),                                                    # sync, no eval
    ((), True, T),                                                     # retaining modes, no eval
    ((EvalLoad("a", 1, eval_groups(T, 1, None)),), False, T),          # sync: eval replaces train sessions
    ((EvalLoad("a", 1, 8), EvalLoad("b", 4, 5)), False, 20),           # sync: max(T, E_peak)
    ((EvalLoad("a", 1, 8), EvalLoad("b", 4, 5)), True, T + 20),        # prelaunch/partial/fully_async: T + E_peak
    ((EvalLoad("a", 4, eval_groups(T, 4, None)),), True, T + 8),       # C_d = ceil(T / G_d) = 2, E_d = 8
])
def test_slot_table_rows(evals: tuple[EvalLoad, ...], retains: bool, required: int) -> None:
    plan = SlotPlan(T, evals, retains)
    assert plan.required == required
    check_slots(plan, required)
    refusal = rf"runtime.external_slots={required - 1} is too few: this run needs {required}"
    with pytest.raises(ValueError, match=refusal):
        check_slots(plan, required - 1)


def test_eval_groups_default_is_ceil_of_train_sessions_over_group_size() -> None:
    assert eval_groups(8, 3, None) == 3 and eval_groups(8, 3, 5) == 5


def _compose(tmp_path: Path, tiny_path: Path, *overrides: str):  # noqa: ANN202 - a DictConfig
    register()
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps({"input": "hi"}) + "\n")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[
            f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=2", f"eval.datasets=[{{name: e, path: '{data}', n_samples_per_prompt: 4}}]",
            *overrides])


def test_check_prints_the_slot_table(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(_compose(tmp_path, tiny_path, "job=check", "runtime=partial", "runtime.external_slots=16"))
    assert metrics["check/required_slots"] == 16
    log = (tmp_path / "run.log").read_text()
    assert "T = 8 train sessions" in log and "eval e: G_d = 4, C_d = 2, E_d = 8" in log
    assert "required slots = T + E_peak (train sessions retained) = 16" in log


def test_too_few_external_slots_refuse_to_start(tmp_path: Path, tiny_path: Path) -> None:
    with pytest.raises(ValueError, match=r"runtime.external_slots=12 is too few: this run needs 16 .*E_peak = 8"):
        run(_compose(tmp_path, tiny_path, "job=rollout", "runtime=fully_async", "runtime.external_slots=12"))
    assert "runtime.external_slots=12 is too few" in (tmp_path / "run.log").read_text().splitlines()[-1]


def _group(tmp_path: Path, store: ForestStore, size: int) -> Group:
    group = Group("g0-0-test", Prompt(0, "hi"), 0, "train", tmp_path)
    group.sessions = [store.open(group.id, i, 0, "train", {}) for i in range(size)]
    return group


def test_active_time_pauses_while_parked_and_expiry_ends_the_process_group(
        tmp_path: Path, tokenizer: object) -> None:
    async def scenario() -> None:
        store = ForestStore()
        group = _group(tmp_path, store, 1)
        session = group.sessions[0]
        process = AgentProcess(AgentSpec("sleep 30 & sleep 30; wait", timeout=1.0, grace_s=0.5))
        group.processes[session.id] = process
        lease = GroupLease(group, store, ScriptedEngine(tokenizer, ["x"]))
        session.lease = lease
        await process.start({"RELAX_SESSION_ID": session.id}, tmp_path / "io")
        lease.grant()
        waiter = asyncio.ensure_future(Runtime(store).run(group))
        await asyncio.sleep(0.4)
        await lease.revoke()
        parked_at = process.timer.elapsed()
        await asyncio.sleep(1.5)  # parked longer than the whole budget
        assert session.status is Status.PARKED and not waiter.done() and _group_alive(process.pid)
        assert process.timer.elapsed() == parked_at
        lease.grant()
        assert await waiter == {}
        assert session.status is Status.FAILED and "timed out after 1 s of active time" in session.error
        assert 1.0 <= process.timer.elapsed() < 1.5 and not _group_alive(process.pid)

    asyncio.run(scenario())


def test_barrier_holds_first_requests_and_names_missing_sessions(
        tmp_path: Path, tokenizer: object, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        store = ForestStore()
        group = _group(tmp_path, store, 2)
        lease = GroupLease(group, store, ScriptedEngine(tokenizer, ["x"]), warn_s=0.2)
        lease.grant()

        async def first_request(index: int) -> None:
            async with lease.generation(group.sessions[index], f"r{index}", 0):
                pass

        early = asyncio.ensure_future(first_request(0))
        await asyncio.sleep(0.5)
        assert not early.done(), "the first session waits for its sibling's first request"
        assert lease.missing() == [group.sessions[1]]
        await asyncio.gather(early, first_request(1))

    with caplog.at_level(logging.WARNING, logger="relax_pipeline.turn.leases"):
        asyncio.run(scenario())
    assert "first-request barrier" in caplog.text and "(index 1)" in caplog.text
