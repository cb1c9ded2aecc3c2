"""`engine=sglang`'s routing keys and KV admission, without servers (engine/sglang/routing.py), and its flags."""

from __future__ import annotations

import asyncio

import pytest

from relax_pipeline.engine.sglang.launch import flags, router_command
from relax_pipeline.engine.sglang.routing import Affinity, KvAdmission, WorkerLoad, WorkerPool


def test_siblings_and_continuations_share_a_key_and_a_shared_preamble_does_not() -> None:
    affinity = Affinity(block=4)
    preamble = list(range(100, 140))  # a long system prompt every task shares
    task_a, task_b = preamble + [1, 2, 3], preamble + [7, 8, 9]
    key_a = affinity.key_for(task_a)
    assert affinity.key_for(task_a) == key_a, "a GRPO sibling (same prompt) gets the first one's key"
    assert affinity.key_for(task_b) != key_a, "another task behind the same preamble gets its own key"
    output = [50, 51, 52, 53, 54, 55]
    affinity.finished(task_a, output, key_a)
    assert affinity.key_for(task_a + output + [60, 61]) == key_a, "the session's next turn continues its key"
    assert affinity.key_for([5]) not in (key_a,), "a prompt shorter than a block still gets a key"


def test_the_pool_keeps_a_key_on_its_worker_and_spreads_new_keys() -> None:
    a, b = WorkerLoad("http://a"), WorkerLoad("http://b")
    pool = WorkerPool([a, b])
    assert pool.pick("k1") is a and pool.pick("k2") is b and pool.pick("k1") is a
    a.reserved = 100
    assert pool.pick("k3") is b, "the least reserved worker takes a new key"


def test_admission_waits_first_come_first_served_and_releases_wake_the_next() -> None:
    async def go() -> list[str]:
        admission, worker, order = KvAdmission(headroom=1.0, max_wait_s=30), WorkerLoad("w", capacity=100), []

        async def job(name: str, tokens: int, hold_s: float) -> None:
            await admission.reserve(worker, tokens)
            order.append(name)
            assert worker.reserved <= 100 or tokens > 100
            await asyncio.sleep(hold_s)
            admission.release(worker, tokens)

        await asyncio.gather(job("a", 60, 0.1), job("b", 60, 0.0), job("c", 30, 0.0), job("huge", 500, 0.0))
        metrics = admission.take_metrics()
        assert metrics["engine/admission_waits"] >= 2 and metrics["engine/kv_reserved"] <= 500
        assert worker.reserved == 0
        return order

    assert asyncio.run(go()) == ["a", "b", "c", "huge"], "c fits beside a but does not overtake b"


def test_admission_gives_up_waiting_after_max_wait_and_counts_it() -> None:
    async def go() -> dict[str, float]:
        admission, worker = KvAdmission(headroom=0.5, max_wait_s=0.2), WorkerLoad("w", capacity=100)
        await admission.reserve(worker, 40)
        await admission.reserve(worker, 40)  # 80 > 50: waits, then starts anyway
        return admission.take_metrics()

    metrics = asyncio.run(go())
    assert metrics["engine/admission_timeouts"] == 1 and metrics["engine/admission_wait_s"] >= 0.2


def test_flags_and_the_router_command() -> None:
    assert flags({"mem_fraction_static": 0.8, "enable_metrics": True, "off": False, "none": None,
                  "dp": [1, 2]}) == ["--mem-fraction-static", "0.8", "--enable-metrics", "--dp", "1", "2"]
    command = router_command("sglang-router", "127.0.0.1", 9, ["http://a", "http://b"], {"policy": "cache_aware"})
    assert command.endswith("--worker-urls http://a http://b --policy cache_aware --assignment-mode min_load")


@pytest.mark.parametrize("bad", [0.0, 1.5])
def test_a_headroom_outside_zero_one_names_the_key(bad: float) -> None:
    with pytest.raises(ValueError, match="engine.kv_headroom"):
        KvAdmission(headroom=bad)
