"""The SGLang-wire fake's KV pool (`testing/kv_pool.py`): least recently used idle KV goes first, a prompt that
needs evicted KV is counted as a re-prefill of its owner, a closed owner's KV is freed, not evicted."""

from __future__ import annotations

import asyncio

from relax_pipeline.testing.kv_pool import KvPool


def seq(first: int, n: int) -> tuple[int, ...]:
    return (first,) + tuple(range(100, 100 + n - 1))


async def turn(pool: KvPool, owner: str, prompt: tuple[int, ...], new: int = 4) -> tuple[int, ...]:
    held = await pool.acquire(owner, prompt, new)
    output = tuple(range(500, 500 + new))
    await pool.release(held, output)
    return prompt + output


def test_idle_kv_is_evicted_least_recently_used_and_its_reprefill_counted() -> None:
    async def go() -> KvPool:
        pool = KvPool(capacity=60)
        a = await turn(pool, "a", seq(1, 20))  # a: 24 idle
        b = await turn(pool, "b", seq(2, 20))  # b: 24 idle, 48 in all
        await turn(pool, "a", a + (7, 7))  # a's next turn reuses its KV (a most recent now)
        assert pool.counts["cached_tokens"] == 24 and pool.counts["evictions"] == 0
        await turn(pool, "c", seq(3, 30))  # needs 34: b (least recent) goes, then a
        assert list(pool.evicted) == ["b", "a"]
        await turn(pool, "b", b + (8, 8))
        return pool

    pool = asyncio.run(go())
    stats = pool.stats()
    assert stats["kv_reprefills"] == 1 and stats["kv_reprefill_tokens"] == 24 and pool.reprefilled == {"b"}


def test_a_request_waits_for_running_ones_and_a_dropped_owner_frees_its_kv() -> None:
    async def go() -> tuple[list[str], KvPool]:
        pool, order = KvPool(capacity=40), []
        first = await pool.acquire("a", seq(1, 20), 10)

        async def second() -> None:
            held = await pool.acquire("b", seq(2, 20), 10)
            order.append("b")
            await pool.release(held, (1,) * 10)

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0)
        order.append("a done")
        await pool.release(first, (1,) * 10)
        await waiting
        await pool.drop("b")
        return order, pool

    order, pool = asyncio.run(go())
    assert order == ["a done", "b"] and pool.counts["queued"] == 1
    assert list(pool.idle) == [] and pool.counts["reprefills"] == 0, "a's KV was evicted for b; b's KV freed at drop"
