"""The SGLang-wire fake's KV pool: SGLang 0.5.23's radix cache as counts. A finite number of KV tokens; idle KV
evicted least recently used (unreferenced before session-referenced); every re-prefill an eviction caused counted;
every prefix served from KV that older weights computed counted; a flush only when asked.

Followed, from the release's source: `sglang/srt/mem_cache/radix_cache.py` (`RadixKey`: a prefix matches only
within its namespace, `cache_salt` (and `extra_key`); entries of another salt never share a node),
`sglang/srt/mem_cache/unified_cache/session_ref_tracker.py` and `sglang/srt/arg_groups/fields/memory.py`
(`--enable-session-radix-cache`: a request of an open session tags its KV with the session; "eviction consumes
unreferenced entries before referenced ones, and closing a session only dereferences its KV"; without the flag
a session's KV is ordinary cache), `sglang/srt/managers/scheduler.py` (`flush_cache`: the whole tree is reset,
only when no request runs or waits; nothing else clears it, a weight update included:
`scheduler_components/weight_updater.py`, `flush_cache_after_weight_update`).

A request holds its prompt plus its `max_new_tokens` while it runs. Its prompt reuses the idle KV of its salt
sharing the longest token prefix with it; what is left is prefilled, and `prefill_s_per_1k` seconds per thousand
prefilled tokens model that cost, one prefill at a time. When the pool cannot hold a new request, idle KV is
evicted (least recently used, unreferenced first); when only running requests remain, the request waits for one
to finish (SGLang's scheduler queue), unless nothing runs. A prompt that shares more tokens with evicted KV than
with live KV is a re-prefill: its owner (the SGLang session id, else the rid) is counted once in
`reprefilled_sessions`, every such prompt in `reprefills`, the tokens computed again in `reprefill_tokens`. Each
entry carries the weight version that computed it (its request's, at prefill); a prompt served from an entry of
another version than the one prefilling it counts in `stale_hits` / `stale_tokens` (SGLang would attend to KV
the old weights computed, while the tokens are stamped with the new version). A finished request's prompt +
output stays as idle KV (the most recently used) under its owner.

What it does not do: store any tensor (the wrapped engine computes the tokens, always with the current weights;
this only counts what SGLang would serve from its cache), split KV between owners that share a prefix (each
entry counts its whole sequence), page-level granularity.
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
class Entry:
    """Idle KV of one owner: its tokens, the namespace it was cached in, the weights that computed it, and the open
    session that references it (session radix cache; None: unreferenced)."""

    tokens: Tokens
    salt: str | None = None
    version: str = "default"
    session: str | None = None


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
    salt: str | None = None
    version: str = "default"
    session: str | None = None


class KvPool:
    """KV tokens of one fake server (see the module)."""

    def __init__(self, capacity: int, prefill_s_per_1k: float = 0.0, max_evicted: int = 10_000,
                 session_refs: bool = False) -> None:
        self.capacity, self.prefill_s_per_1k, self.max_evicted = capacity, prefill_s_per_1k, max_evicted
        self.session_refs = session_refs
        """`--enable-session-radix-cache`: open sessions reference their KV (evicted after unreferenced KV)."""
        self.idle: OrderedDict[str, Entry] = OrderedDict()
        """Owner → the KV it left (least recently used first)."""
        self.evicted: OrderedDict[str, Entry] = OrderedDict()
        """Owner → the KV eviction took from it (until it is computed again)."""
        self.referencing: set[str] = set()
        """Open sessions whose KV is referenced (session_refs only)."""
        self.running = 0
        """Tokens held by running requests (SGLang's `num_used_tokens`)."""
        self.counts = {"evictions": 0, "evicted_tokens": 0, "referenced_evictions": 0, "reprefills": 0,
                       "reprefill_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0, "queued": 0, "stale_hits": 0,
                       "stale_tokens": 0, "flushes": 0}
        self.reprefilled: set[str] = set()
        self._freed = asyncio.Condition()
        self._compute = asyncio.Lock()

    @property
    def idle_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.idle.values())

    @property
    def referenced_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.idle.values() if self._referenced(e))

    async def acquire(self, owner: str, prompt: Tokens, max_new_tokens: int, salt: str | None = None,
                      version: str = "default", session: str | None = None) -> Held:
        """Room for a request of `owner` (evicting idle KV, else waiting for a running request); its prefill under
        weights `version`, its prefix looked up among entries of `salt`."""
        cached, source = self._best(self.idle, prompt, salt)
        if source is not None:
            entry = self.idle.pop(source)  # the request takes that KV over (it extends or forks it)
            if entry.version != version:
                self.counts["stale_hits"] += 1
                self.counts["stale_tokens"] += cached
        tokens = len(prompt) + max_new_tokens
        async with self._freed:
            if not self._fits(tokens):
                self.counts["queued"] += 1
            await self._freed.wait_for(lambda: self._fits(tokens))
            self.running += tokens
        lost = self._count_reprefill(owner, prompt, cached, salt)
        self.counts["prefill_tokens"] += len(prompt) - cached
        self.counts["cached_tokens"] += cached
        if self.prefill_s_per_1k > 0:
            async with self._compute:
                await asyncio.sleep(self.prefill_s_per_1k * (len(prompt) - cached) / 1000)
        return Held(owner, tokens, cached, prompt, lost, salt, version, session)

    async def release(self, held: Held, output: Tokens) -> None:
        """The request ended: its prompt + output stay as idle KV of its owner (referenced by its open session)."""
        self.idle.pop(held.owner, None)
        session = held.session if held.session in self.referencing else None
        self.idle[held.owner] = Entry(held.prompt + output, held.salt, held.version, session)
        self.evicted.pop(held.owner, None)
        async with self._freed:
            self.running -= held.tokens
            self._freed.notify_all()

    def open_session(self, session_id: str) -> None:
        """`/open_session`: with session_refs, the session's KV will be referenced until it closes."""
        if self.session_refs:
            self.referencing.add(session_id)

    def close_session(self, session_id: str) -> None:
        """`/close_session`: the session's KV is dereferenced (still cached, evictable like any), never freed."""
        self.referencing.discard(session_id)

    def flush(self) -> bool:
        """`flush_cache`: drop every idle entry, only when no request runs (SGLang refuses otherwise); whether done."""
        if self.running:
            return False
        self.idle.clear()
        self.evicted.clear()
        self.counts["flushes"] += 1
        return True

    def stats(self) -> dict[str, int]:
        return {"kv_capacity": self.capacity, "kv_running_tokens": self.running, "kv_idle_tokens": self.idle_tokens,
                "kv_referenced_tokens": self.referenced_tokens, "kv_reprefilled_sessions": len(self.reprefilled)} | {
            f"kv_{k}": v for k, v in self.counts.items()}

    def prometheus(self, model: str) -> str:
        """SGLang's Prometheus gauges of the pool: tokens held by running requests, and the capacity."""
        labels = f'{{model_name="{model}"}}'
        return (f"# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{labels} {self.running}\n"
                f"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{labels} {self.capacity}\n")

    def _referenced(self, entry: Entry) -> bool:
        return entry.session is not None and entry.session in self.referencing

    def _victim(self) -> str:
        """The entry eviction takes next: the least recently used unreferenced one, else the least recently used."""
        return next((o for o, e in self.idle.items() if not self._referenced(e)), next(iter(self.idle)))

    def _fits(self, tokens: int) -> bool:
        """Whether `tokens` fit once idle KV is evicted (see `_victim`); evicts what it must."""
        while self.running + self.idle_tokens + tokens > self.capacity and self.idle:
            owner = self._victim()
            entry = self.idle.pop(owner)
            self.counts["referenced_evictions"] += self._referenced(entry)
            self.evicted[owner] = entry
            self.counts["evictions"] += 1
            self.counts["evicted_tokens"] += len(entry.tokens)
            while len(self.evicted) > self.max_evicted:
                self.evicted.popitem(last=False)
        return self.running == 0 or self.running + tokens <= self.capacity  # alone: it runs whatever its size

    def _count_reprefill(self, owner: str, prompt: Tokens, cached: int, salt: str | None) -> int:
        """Tokens of `prompt` past `cached` that evicted KV held (computed again), counted; 0 for none."""
        lost, source = self._best(self.evicted, prompt, salt)
        if source is None or lost <= cached:
            return 0
        self.evicted.pop(source)
        self.reprefilled.add(owner)
        self.counts["reprefills"] += 1
        self.counts["reprefill_tokens"] += lost - cached
        return lost - cached

    @staticmethod
    def _best(entries: OrderedDict[str, Entry], prompt: Tokens, salt: str | None) -> tuple[int, str | None]:
        """The entry of namespace `salt` sharing the longest prefix with `prompt` (at least one token), that length."""
        best, owner = 0, None
        for name, entry in entries.items():
            shared = _common(entry.tokens, prompt) if entry.salt == salt else 0
            if shared > best:
                best, owner = shared, name
        return best, owner
