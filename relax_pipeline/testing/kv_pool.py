"""The SGLang-wire fake's KV pool: a finite number of KV tokens, idle KV evicted least recently used, and every
re-prefill an eviction caused counted (what program-aware admission is measured by).

A request holds its prompt plus its `max_new_tokens` while it runs. Its prompt reuses the idle KV sharing the
longest token prefix with it (an SGLang session's previous turn, or a plain request's previous prompt +
output, as SGLang's radix cache would); what is left is prefilled, and `prefill_s_per_1k` seconds per thousand
prefilled tokens model that cost, one prefill at a time (the server's compute is shared: a prefill is not free
for the others). When the pool cannot hold a new request, idle KV is evicted least recently
used; when only running requests remain, the request waits for one to finish (SGLang's scheduler queue),
unless nothing runs. A prompt that shares more tokens with evicted KV than with live KV is a re-prefill: its
owner (the SGLang session id, else the rid) is counted once in `reprefilled_sessions`, every such prompt in
`reprefills`, and the tokens computed again in `reprefill_tokens`. A finished request's prompt + output stays
as idle KV (the most recently used) under its owner; `drop(owner)` frees an owner's KV at once
(`/close_session`).

What it does not do: store any tensor (the wrapped engine computes the tokens; this only counts), split KV
between owners that share a prefix (each entry counts its whole sequence), page-level granularity.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

Tokens = tuple[int, ...]


def _common(a: Tokens, b: Tokens) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Held:
    """What one running request holds in the pool."""

    owner: str
    tokens: int
    """Prompt + max_new_tokens: the pool tokens it holds while it runs."""
    cached: int
    """Prompt tokens taken from idle KV (not prefilled)."""
    prompt: Tokens
    reprefilled: int = 0
    """Prompt tokens computed again because eviction took them."""


class KvPool:
    """KV tokens of one fake server (see the module)."""

    def __init__(self, capacity: int, prefill_s_per_1k: float = 0.0, max_evicted: int = 10_000) -> None:
        self.capacity, self.prefill_s_per_1k, self.max_evicted = capacity, prefill_s_per_1k, max_evicted
        self.idle: OrderedDict[str, Tokens] = OrderedDict()
        """Owner → the KV it left (least recently used first)."""
        self.evicted: OrderedDict[str, Tokens] = OrderedDict()
        """Owner → the KV eviction took from it (until it is computed again)."""
        self.running = 0
        """Tokens held by running requests (SGLang's `num_used_tokens`)."""
        self.counts = {"evictions": 0, "evicted_tokens": 0, "reprefills": 0, "reprefill_tokens": 0,
                       "prefill_tokens": 0, "cached_tokens": 0, "queued": 0}
        self.reprefilled: set[str] = set()
        self._freed = asyncio.Condition()
        self._compute = asyncio.Lock()

    @property
    def idle_tokens(self) -> int:
        return sum(len(t) for t in self.idle.values())

    async def acquire(self, owner: str, prompt: Tokens, max_new_tokens: int) -> Held:
        """Room for a request of `owner` (evicting idle KV, else waiting for a running request); its prefill."""
        cached, source = self._best(self.idle, prompt)
        if source is not None:
            self.idle.pop(source)  # the request takes that KV over (it extends or forks it)
        tokens = len(prompt) + max_new_tokens
        async with self._freed:
            if not self._fits(tokens):
                self.counts["queued"] += 1
            await self._freed.wait_for(lambda: self._fits(tokens))
            self.running += tokens
        lost = self._count_reprefill(owner, prompt, cached)
        self.counts["prefill_tokens"] += len(prompt) - cached
        self.counts["cached_tokens"] += cached
        if self.prefill_s_per_1k > 0:
            async with self._compute:
                await asyncio.sleep(self.prefill_s_per_1k * (len(prompt) - cached) / 1000)
        return Held(owner, tokens, cached, prompt, lost)

    async def release(self, held: Held, output: Tokens) -> None:
        """The request ended: its prompt + output stay as idle KV of its owner."""
        self.idle.pop(held.owner, None)
        self.idle[held.owner] = held.prompt + output
        self.evicted.pop(held.owner, None)
        async with self._freed:
            self.running -= held.tokens
            self._freed.notify_all()

    async def drop(self, owner: str) -> None:
        """`owner` ended (its SGLang session closed): its idle KV is freed, not evicted."""
        self.idle.pop(owner, None)
        self.evicted.pop(owner, None)
        async with self._freed:
            self._freed.notify_all()

    def stats(self) -> dict[str, int]:
        return {"kv_capacity": self.capacity, "kv_running_tokens": self.running, "kv_idle_tokens": self.idle_tokens,
                "kv_reprefilled_sessions": len(self.reprefilled)} | {f"kv_{k}": v for k, v in self.counts.items()}

    def prometheus(self, model: str) -> str:
        """SGLang's Prometheus gauges of the pool: tokens held by running requests, and the capacity."""
        labels = f'{{model_name="{model}"}}'
        return (f"# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{labels} {self.running}\n"
                f"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{labels} {self.capacity}\n")

    def _fits(self, tokens: int) -> bool:
        """Whether `tokens` fit once idle KV is evicted (least recently used first); evicts what it must."""
        while self.running + self.idle_tokens + tokens > self.capacity and self.idle:
            owner, kv = self.idle.popitem(last=False)
            self.evicted[owner] = kv
            self.evicted.move_to_end(owner)
            self.counts["evictions"] += 1
            self.counts["evicted_tokens"] += len(kv)
            while len(self.evicted) > self.max_evicted:
                self.evicted.popitem(last=False)
        return self.running == 0 or self.running + tokens <= self.capacity  # alone: it runs whatever its size

    def _count_reprefill(self, owner: str, prompt: Tokens, cached: int) -> int:
        """Tokens of `prompt` past `cached` that evicted KV held (computed again), counted; 0 for none."""
        lost, source = self._best(self.evicted, prompt)
        if source is None or lost <= cached:
            return 0
        self.evicted.pop(source)
        self.reprefilled.add(owner)
        self.counts["reprefills"] += 1
        self.counts["reprefill_tokens"] += lost - cached
        return lost - cached

    @staticmethod
    def _best(entries: OrderedDict[str, Tokens], prompt: Tokens) -> tuple[int, str | None]:
        """The entry sharing the longest prefix with `prompt` (at least one token) and that length."""
        best, owner = 0, None
        for name, tokens in entries.items():
            shared = _common(tokens, prompt)
            if shared > best:
                best, owner = shared, name
        return best, owner
