"""Runtime modes end to end: prelaunch, request-level partial rollout, fully async, and no lost session.

Real gateway, real agent subprocesses (`examples/long_tail_agent`), real stages and strategies; the
engine is `testing.engines.PacedEngine` (time proportional to tokens, abortable, letters in a cycle so lost or
duplicated tokens show) so the scheduler is what is tested. Steps are driven through the strategy
directly where a test needs to act between them (a simulated optimizer step, a weight update).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from relax_pipeline.config import CONF_DIR, quote_placeholders, records, register
from relax_pipeline.loop import StepLoop
from relax_pipeline.recipes.parts import Job, Plan, Teardown, assemble
from relax_pipeline.run import run
from relax_pipeline.stages.pipeline import StepResult
from relax_pipeline.testing.engines import LETTERS, register_paced

PACED = "engine=paced"
DONE = ("completed", "truncated")


def _dataset(tmp_path: Path, metadata: list[dict[str, Any]]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"input": f"task {i}", "metadata": m}) + "\n" for i, m in enumerate(metadata)))
    return path


def _cfg(tmp_path: Path, tiny_path: Path, data: Path, *overrides: str) -> DictConfig:
    register()
    register_paced()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "job=rollout", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=false", "agent=long_tail", PACED, "rollout.max_response_len=1000",
            "rollout.max_context_len=4096", f"debug.save_rollout_data={tmp_path}/r_{{rollout_id}}.jsonl", *overrides,
        ]))


def _events(tmp_path: Path, group_id: str, index: int) -> list[dict[str, Any]]:
    path = tmp_path / "sessions" / f"{group_id}-{index}" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(tmp_path.glob("r_*.jsonl")) for line in p.read_text().splitlines()]


async def _steps(cfg: DictConfig, tmp_path: Path, between: Any) -> list[StepResult]:
    """Run rollout steps through the strategy, awaiting `between(parts, step)` after each."""
    config = records(cfg)
    plan = Plan.of(config, tmp_path)
    async with Teardown(plan) as teardown:
        job = Job(config, tmp_path, OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
        loop = await assemble(job, plan, teardown, None, cfg.rollout.num_steps)
        results = []
        for step in range(cfg.rollout.num_steps):
            results.append(await loop.strategy.rollout(loop.pipeline, step))
            await between(loop, step)
        return results


def test_prelaunch_holds_first_requests_and_pauses_the_timeout_clock(tmp_path: Path, tiny_path: Path) -> None:
    data = _dataset(tmp_path, [{"startup_s": 2.0, "turns": 1, "max_tokens": 8}] * 4)
    cfg = _cfg(tmp_path, tiny_path, data, "runtime=prelaunch", "rollout.num_steps=2", "rollout.batch_size=1",
               "rollout.n_samples_per_prompt=2", "agent.timeout=2.8")
    opened: dict[int, float] = {}

    async def optimizer_step(loop: StepLoop, step: int) -> None:
        await asyncio.sleep(3.0)  # longer than the agents' start-up and than their whole timeout
        opened[step + 1] = time.time()

    results = asyncio.run(_steps(cfg, tmp_path, optimizer_step))
    second = [g for g in results[1].groups if not g.excluded]
    assert len(second) == 1 and results[1].metrics["rollout/dropped_groups"] == 0
    for session in second[0].sessions:
        request, response = _events(tmp_path, second[0].id, session.index)
        assert request["t"] < opened[1], "the first request was sent during the previous step and held"
        assert response["t"] > opened[1], "and answered once the next step leased the group"
        assert second[0].processes[session.id].timer.elapsed() < 1.0, "the clock did not run while held"
    assert {r["status"] for r in _rows(tmp_path) if r["rollout_id"] == 1} <= set(DONE)


def _partial_cfg(tmp_path: Path, tiny_path: Path, max_aborted: int) -> DictConfig:
    data = _dataset(tmp_path, [{"max_tokens": m, "turns": 1} for m in (120, 300, 900)])
    return _cfg(tmp_path, tiny_path, data, "runtime=partial", "rollout.num_steps=2", "rollout.batch_size=1",
                "rollout.over_sampling_batch_size=2", "rollout.n_samples_per_prompt=1", "engine.token_s=0.005",
                "engine.mean_tokens=5000", "engine.sigma=0.01", f"runtime.max_aborted_count={max_aborted}")


async def _new_weights(loop: StepLoop, step: int) -> None:
    await loop.engine.update_weights({}, step + 1)


def _long_row(tmp_path: Path) -> dict[str, Any]:
    rows = [r for r in _rows(tmp_path) if r["status"] in DONE and r["response_length"] == 300]
    assert len(rows) == 1, [(r["status"], r["response_length"]) for r in _rows(tmp_path)]
    return rows[0]


def _letters(row: dict[str, Any], tiny_path: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    return tokenizer.decode(row["tokens"][row["prompt_length"]:]).replace(" ", "")


def test_partial_rollout_resumes_an_aborted_generation_in_the_next_step(tmp_path: Path, tiny_path: Path) -> None:
    results = asyncio.run(_steps(_partial_cfg(tmp_path, tiny_path, max_aborted=2), tmp_path, _new_weights))
    assert results[0].metrics["rollout/parked_groups"] == 1 and results[0].metrics["rollout/aborted_generations"] == 1
    row = _long_row(tmp_path)
    assert row["rollout_id"] == 0 and row["group_id"].startswith("g0-1-"), "started in step 0, finished in step 1"
    assert row["abort_count"] == 1
    versions = row["weight_versions"]
    assert versions == sorted(versions) and set(versions) == {0, 1}, "tokens keep the version that made them"
    assert _letters(row, tiny_path) == (LETTERS * 12)[:300], "no token lost or duplicated across the abort"
    assert row["loss_mask"] == [1] * 300
    (turn,) = row["timing"]["turns"]
    assert turn["queue_ms"] > 1.0 and turn["generation_ms"] > 0, "the parked time between the pieces is queue"


def test_partial_rollout_protects_a_request_after_max_aborted_count(tmp_path: Path, tiny_path: Path) -> None:
    results = asyncio.run(_steps(_partial_cfg(tmp_path, tiny_path, max_aborted=0), tmp_path, _new_weights))
    assert results[0].metrics["rollout/aborted_generations"] == 0
    row = _long_row(tmp_path)
    assert row["abort_count"] == 0 and set(row["weight_versions"]) == {0}, "step close waited for it to finish"
    assert _letters(row, tiny_path) == (LETTERS * 12)[:300]


def _async_cfg(tmp_path: Path, tiny_path: Path, *overrides: str) -> DictConfig:
    long_then_short = [{"max_tokens": 600, "turns": 1}] + [{"max_tokens": 16, "turns": 1}] * 7
    data = _dataset(tmp_path, long_then_short)
    return _cfg(tmp_path, tiny_path, data, "job=train", "runtime=fully_async", "rollout.num_steps=3",
                "rollout.batch_size=1", "runtime.concurrency=2", "rollout.n_samples_per_prompt=2",
                "engine.token_s=0.005", "engine.mean_tokens=5000", "engine.sigma=0.01", *overrides)


def test_fully_async_sessions_span_steps_and_the_last_step_drains(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(_async_cfg(tmp_path, tiny_path, "runtime.max_staleness=null"))
    rows = _rows(tmp_path)
    long = [r for r in rows if r["status"] in DONE and r["response_length"] == 600]
    assert len(long) == 2 and all(r["rollout_id"] == 0 for r in long)
    assert all(len(set(r["weight_versions"])) >= 2 for r in long), "preempted and resumed on new weights"
    last = [r for r in rows if r["group_id"] in {x["group_id"] for x in long}]
    assert {r["status"] for r in last} <= set(DONE)
    assert len({r["session_id"] for r in rows}) == len(list((tmp_path / "sessions").iterdir())), "none left"
    assert metrics["rollout/stale_groups"] == 0


def test_fully_async_drops_and_counts_stale_groups(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(_async_cfg(tmp_path, tiny_path, "runtime.max_staleness=1"))
    rows = _rows(tmp_path)
    stale = [r for r in rows if r["status"] == "dropped" and r["error"].startswith("stale")]
    assert stale and all("runtime.max_staleness=1" in r["error"] for r in stale)
    assert any(r["group_id"].startswith("g0-0-") for r in stale), "the long group's first token was v0"
    assert metrics["rollout/stale_groups"] >= 1, "the last step counts what it dropped"


COMBINED = ("runtime=prelaunch", "runtime.partial_rollout=true")
"""The switches combined: prelaunch and partial rollout together (`PrelaunchPartialRuntime`)."""


@pytest.mark.parametrize("mode", [("runtime=sync",), ("runtime=prelaunch",), ("runtime=partial",),
                                  ("runtime=fully_async",), COMBINED, ("runtime=fully_async",
                                                                       "runtime.partial_rollout=true")])
def test_no_mode_loses_a_session(tmp_path: Path, tiny_path: Path, mode: tuple[str, ...]) -> None:
    data = _dataset(tmp_path, [{"turns": 2, "tool_mean_s": 0.2, "max_tokens": 64}] * 6)
    run(_cfg(tmp_path, tiny_path, data, *mode, "rollout.num_steps=3", "rollout.batch_size=2",
             "rollout.over_sampling_batch_size=3", "rollout.n_samples_per_prompt=2", "engine.token_s=0.003"))
    rows = _rows(tmp_path)
    sessions = {p.name for p in (tmp_path / "sessions").iterdir()}
    recorded = {f"{r['group_id']}-{r['index']}" for r in rows}
    assert recorded == sessions, "every started session ends as a sample or a dropped/failed record"
    assert all(r["status"] in (*DONE, "dropped") for r in rows)
    assert sum(r["status"] in DONE for r in rows) >= 3 * 2 * 2


def test_a_group_that_fails_inside_the_pipeline_is_recorded_and_replaced(
        tmp_path: Path, tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_pipeline.stages.runtime import Runtime

    original, calls = Runtime.run, []

    async def flaky(self: Runtime, group: Any, *args: Any) -> Any:
        calls.append(group.id)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return await original(self, group, *args)

    monkeypatch.setattr(Runtime, "run", flaky)
    data = _dataset(tmp_path, [{"turns": 1, "max_tokens": 8}] * 3)
    metrics = run(_cfg(tmp_path, tiny_path, data, "rollout.num_steps=1", "rollout.batch_size=1",
                       "rollout.n_samples_per_prompt=2"))
    rows = _rows(tmp_path)
    failed = [r for r in rows if r["group_id"] == calls[0]]
    assert [r["status"] for r in failed] == ["dropped", "dropped"]
    assert all(r["error"] == "internal error: RuntimeError: boom" for r in failed)
    assert metrics["rollout/dropped_groups"] == 1 and sum(r["status"] in DONE for r in rows) == 2


def test_prelaunch_with_partial_rollout_parks_then_fills_the_capacity_left(tmp_path: Path, tiny_path: Path) -> None:
    """Step close parks the unfinished (long) group, then prelaunches the next step's groups into the capacity it
    leaves (wanted 2, 1 parked: 1 prelaunched); the parked generation is resumed next step; nothing is lost."""
    long_then_short = [{"max_tokens": 300, "turns": 1}] + [{"max_tokens": 8, "turns": 1}] * 5
    data = _dataset(tmp_path, long_then_short)
    metrics = run(_cfg(tmp_path, tiny_path, data, *COMBINED, "job=train", "rollout.num_steps=2",
                       "rollout.batch_size=1", "rollout.over_sampling_batch_size=2", "runtime.concurrency=3",
                       "rollout.n_samples_per_prompt=1", "engine.token_s=0.004", "engine.mean_tokens=5000",
                       "engine.sigma=0.01"))
    first = next(line for line in (tmp_path / "run.log").read_text().splitlines() if "step 0 metrics" in line)
    assert "rollout/parked_groups=1 " in first and "rollout/prelaunched_groups=1 " in first
    rows = _rows(tmp_path)
    long = [r for r in rows if r["group_id"].startswith("g0-0-")]
    assert len(long) == 1 and long[0]["abort_count"] >= 1, "parked at step 0's close, resumed in step 1"
    sessions = {p.name for p in (tmp_path / "sessions").iterdir()}
    assert {f"{r['group_id']}-{r['index']}" for r in rows} == sessions
    assert metrics["train/weight_version"] == 2


@pytest.mark.parametrize("overrides, fragment", [
    (("runtime=fully_async", "runtime.prelaunch=true"), "runtime.fully_async=true with runtime.prelaunch=true"),
    (("runtime=sync", "runtime.max_staleness=3"), "runtime.max_staleness=3 is not used by SyncRuntime"),
])
def test_a_combination_that_cannot_work_is_refused_at_start(tmp_path: Path, tiny_path: Path,
                                                            overrides: tuple[str, ...], fragment: str) -> None:
    data = _dataset(tmp_path, [{"max_tokens": 8, "turns": 1}])
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        run(_cfg(tmp_path, tiny_path, data, "job=check", *overrides))

