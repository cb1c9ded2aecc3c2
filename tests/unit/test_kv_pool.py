"""The SGLang-wire fake's KV pool (`testing/kv_pool.py`), as SGLang 0.5.23's radix cache: least recently used idle
KV goes first (unreferenced before session-referenced), a prompt that needs evicted KV is counted as a re-prefill
of its owner, a closed session's KV is dereferenced (still cached), a prefix matches only within its `cache_salt`,
KV older weights computed is counted when served, and a flush happens only when nothing runs."""

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


def test_a_request_waits_for_running_ones() -> None:
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
        return order, pool

    order, pool = asyncio.run(go())
    assert order == ["a done", "b"] and pool.counts["queued"] == 1
    assert list(pool.idle) == ["b"] and pool.counts["reprefills"] == 0, "a's KV was evicted for b"


def test_open_sessions_are_evicted_last_and_a_closed_one_is_dereferenced_not_freed() -> None:
    async def go() -> KvPool:
        pool = KvPool(capacity=60, session_refs=True)
        pool.open_session("s")
        held = await pool.acquire("s", seq(1, 20), 4, session="s")
        await pool.release(held, (9,) * 4)  # s: 24, referenced
        await turn(pool, "p", seq(2, 20))  # p: 24, unreferenced and more recent
        await turn(pool, "q", seq(3, 10))  # needs 14: p goes, not the older but referenced s
        assert list(pool.evicted) == ["p"] and pool.referenced_tokens == 24
        pool.close_session("s")
        assert pool.referenced_tokens == 0 and pool.idle_tokens == 24 + 14, "dereferenced, still cached"
        await turn(pool, "r", seq(4, 20))  # needs 24: s (least recent, no longer referenced) goes first
        assert list(pool.evicted) == ["p", "s"]
        return pool

    assert asyncio.run(go()).counts["referenced_evictions"] == 0


def test_a_prefix_matches_within_its_salt_and_old_weights_kv_is_counted_when_served() -> None:
    async def go() -> KvPool:
        pool = KvPool(capacity=1000)
        prompt = seq(1, 20)
        for salt, version in (("v0", "default"), ("v1", "1"), (None, "1")):
            held = await pool.acquire(f"{salt}", prompt, 4, salt=salt, version=version)
            assert held.cached == 0, "another namespace shares nothing"
            await pool.release(held, (9,) * 4)
        stale = await pool.acquire("late", prompt, 4, salt="v0", version="1")  # served old weights' KV
        assert stale.cached == 20
        return pool

    pool = asyncio.run(go())
    assert pool.counts["stale_hits"] == 1 and pool.counts["stale_tokens"] == 20


def test_a_flush_happens_only_when_nothing_runs() -> None:
    async def go() -> tuple[bool, bool, KvPool]:
        pool = KvPool(capacity=100)
        await turn(pool, "a", seq(1, 10))
        running = await pool.acquire("b", seq(2, 10), 4)
        refused = pool.flush()
        await pool.release(running, (1,) * 4)
        return refused, pool.flush(), pool

    refused, done, pool = asyncio.run(go())
    assert not refused and done and pool.idle_tokens == 0 and pool.counts["flushes"] == 1
