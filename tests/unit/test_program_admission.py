"""Program-aware admission (`engine/program_admission.py`): the ledger's FIFO, fail-open, TTL leases and the
growth it learns; the wrapper's abort of a waiting turn; the settings' errors. A fake clock drives every
expiry, so no test depends on time."""

from __future__ import annotations

import asyncio

import pytest

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.program_admission import (
    GrowthModel,
    ProgramAdmission,
    ProgramLedger,
    prometheus_sum,
    task_key,
)
from relax_pipeline.engine.settings import HFEngineSettings, ProgramPart, SglangEngineSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ledger(capacity: int = 1000, prior: int = 0, lease_s: float = 1e6, clock: Clock | None = None) -> ProgramLedger:
    book = ProgramLedger(1.0, 1e6, lease_s, prior, clock or Clock())
    book.capacity = capacity
    return book


def prompt(n: int, task: int = 0) -> list[int]:
    return [task] + [7] * (n - 1)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def admit_all(book: ProgramLedger, order: list[str], *sessions: tuple[str, int, int]) -> list[asyncio.Task[None]]:
    """Start admissions in this order (one loop turn apart); each appends its name once admitted."""
    async def one(name: str, size: int, task: int) -> None:
        await book.admit(name, prompt(size, task), 0)
        order.append(name)

    tasks = []
    for name, size, task in sessions:
        tasks.append(asyncio.create_task(one(name, size, task)))
        await settle()
    return tasks


@pytest.mark.asyncio
async def test_waiting_sessions_are_admitted_first_in_first_out() -> None:
    book, order = ledger(), []
    tasks = await admit_all(book, order, ("a", 500, 0), ("b", 600, 1), ("c", 100, 2))
    assert order == ["a"], "b does not fit next to a, and c may not overtake b although it fits"
    book.end("a")
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"]
    assert book.leased == 700
    metrics = book.take_metrics()
    assert metrics["agentic_kv/admitted"] == 3 and metrics["agentic_kv/waiting"] == 2
    assert metrics["agentic_kv/fail_open"] == 0


@pytest.mark.asyncio
async def test_an_admitted_session_never_waits_for_its_next_turn() -> None:
    book, order = ledger(), []
    await admit_all(book, order, ("a", 500, 0), ("b", 600, 1))
    book.turn_done("a", 520)
    await asyncio.wait_for(book.admit("a", prompt(540), 100), 5)
    assert book.programs["a"].tokens == 640 and order == ["a"]


@pytest.mark.asyncio
async def test_unknown_capacity_admits_everyone() -> None:
    book, order = ledger(capacity=0), []
    await admit_all(book, order, ("a", 5000, 0), ("b", 6000, 1), ("c", 7000, 2))
    assert order == ["a", "b", "c"]
    assert book.take_metrics()["agentic_kv/fail_open"] == 1


@pytest.mark.asyncio
async def test_an_idle_lease_expires_and_lets_the_queue_in() -> None:
    clock = Clock()
    book, order = ledger(lease_s=30, clock=clock), []
    tasks = await admit_all(book, order, ("a", 600, 0))
    book.turn_done("a", 650)
    tasks += await admit_all(book, order, ("b", 600, 1))
    clock.now = 29
    book.expire()
    await settle()
    assert order == ["a"]
    clock.now = 31
    book.expire()
    await asyncio.gather(*tasks)
    assert order == ["a", "b"] and book.programs["a"].tokens == 0
    assert book.take_metrics()["agentic_kv/expired"] == 1
    again = asyncio.create_task(book.admit("a", prompt(700), 0))
    await settle()
    assert not again.done(), "an expired session waits in the queue again"
    book.end("b")
    await asyncio.wait_for(again, 5)


@pytest.mark.asyncio
async def test_a_turn_in_flight_keeps_its_lease() -> None:
    clock = Clock()
    book, order = ledger(lease_s=30, clock=clock), []
    await admit_all(book, order, ("a", 600, 0))
    clock.now = 1000
    book.expire()
    assert book.programs["a"].tokens == 600


@pytest.mark.asyncio
async def test_growth_is_learned_per_task_with_the_overall_mean_for_new_tasks() -> None:
    book, order = ledger(capacity=10**6, prior=100), []
    await admit_all(book, order, ("a", 50, 1))
    assert book.programs["a"].tokens == 150, "the prior before any session finished"
    book.turn_done("a", 350)
    book.end("a")
    metrics = book.take_metrics()
    assert (metrics["agentic_kv/predicted_tokens"], metrics["agentic_kv/actual_tokens"]) == (150, 350)
    await admit_all(book, order, ("b", 50, 1), ("c", 80, 2))
    assert book.programs["b"].tokens == 350, "task 1 grew by 300"
    assert book.programs["c"].tokens == 380, "an unseen task takes the overall growth"
    book.turn_done("c", 180)
    book.end("c")
    assert book.growth.expected(task_key(prompt(80, 2))) == 100
    assert book.growth.expected(task_key(prompt(50, 1))) == 300


def test_the_growth_model_is_an_ewma() -> None:
    model = GrowthModel(prior=64, alpha=0.5)
    assert model.expected("t") == 64
    model.learn("t", 100)
    model.learn("t", 300)
    assert model.expected("t") == 200


@pytest.mark.asyncio
async def test_the_engines_load_counts_when_it_exceeds_the_leases() -> None:
    book, order = ledger(), []

    async def load() -> int:
        return 900

    book.reader = load
    await admit_all(book, order, ("a", 50, 0), ("b", 200, 1))
    assert order == ["a"], "900 tokens in use: 200 more do not fit"


@pytest.mark.asyncio
async def test_a_wait_past_max_wait_s_lets_the_session_in() -> None:
    book, order = ProgramLedger(1.0, 0.01, 1e6, 0), []
    book.capacity = 1000
    await admit_all(book, order, ("a", 900, 0))
    await asyncio.wait_for(book.admit("b", prompt(900), 0), 5)
    assert book.take_metrics()["agentic_kv/timeouts"] == 1


@pytest.mark.asyncio
async def test_abort_ends_a_turn_waiting_for_admission() -> None:
    book = ledger()
    admission = ProgramAdmission(book, lambda: 3)
    calls: list[str] = []

    async def call() -> GenerateResult:
        calls.append("generate")
        return GenerateResult((1, 2), (-0.1, -0.2), "stop", 3)

    sampling = SamplingParams(max_new_tokens=0)
    first = await admission.generate(call, prompt(900), sampling, "r1", "a")
    assert first.output_ids == (1, 2) and book.programs["a"].context == 902
    waiting = asyncio.create_task(admission.generate(call, prompt(900, 1), sampling, "r2", "b"))
    await settle()
    assert admission.abort("r2") is not None
    result = await asyncio.wait_for(waiting, 5)
    assert (result.finish_reason, result.output_ids, result.weight_version) == ("abort", (), 3)
    assert calls == ["generate"] and admission.abort("r2") is None
    assert (await admission.generate(call, prompt(10), sampling, "r3", None)).finish_reason == "stop"


def test_prometheus_samples_are_summed() -> None:
    text = ('# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{model_name="m",dp="0"} 120.0\n'
            'sglang:num_used_tokens{model_name="m",dp="1"} 30\nsglang:num_used_tokens_swa 99\n')
    assert prometheus_sum(text, "sglang:num_used_tokens") == 150
    assert prometheus_sum(text, "sglang:token_usage") is None


@pytest.mark.parametrize(("key", "value"), [("admission_lease_s", 0.0), ("kv_headroom", 1.5),
                                            ("admission_max_wait_s", -1.0), ("admission_growth_prior", -5)])
def test_bad_admission_keys_fail_naming_the_key(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"engine.{key}="):
        SglangEngineSettings(urls=["http://x"], admission="program", **{key: value})
    with pytest.raises(ValueError, match=f"engine.{key}="):
        HFEngineSettings(admission="program", **{key: value})


def test_the_settings_hand_out_the_program_part() -> None:
    assert SglangEngineSettings(urls=["http://x"], admission="program").program_part == ProgramPart(
        0.9, 300.0, 600.0, 1024)
    assert SglangEngineSettings(urls=["http://x"], admission="kv").program_part is None
    assert HFEngineSettings().program_part is None
    with pytest.raises(ValueError, match=r"engine.admission='kv'.*\['none', 'program'\]"):
        HFEngineSettings(admission="kv")
