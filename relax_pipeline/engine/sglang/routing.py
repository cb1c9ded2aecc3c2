"""Where an SGLang generation goes, and whether it may start yet: cache affinity and KV-aware admission.

`Affinity` gives every prompt a routing key so that requests sharing a cached prefix land on the same
worker: a GRPO sibling (the same prompt, sent while the first one is in flight) gets the key of the first,
and a session's next turn (its previous prompt + generated tokens + the new observation) gets the key of
the turn it continues. Prompts are compared on token ids through chained block hashes (one hash per
`block` tokens, each hash covering the whole prefix up to it), so a lookup costs time linear in the prompt
and no text is involved. What is registered: the exact prompt at dispatch (siblings) and the last block
boundary of prompt + output once a generation finished (continuations). Prompts that only share a system
preamble do not inherit each other's key (a preamble boundary is never registered). The table is an LRU
bounded by `max_keys`; an evicted key only costs cache affinity, never correctness.

`WorkerPool` is the client-side router used without `engine.router`: a key sticks to the worker it was
first given; a new key goes to the worker with the fewest reserved tokens (then fewest in flight). Behind
smg (`engine.router=smg`) the key travels as the `x-smg-routing-key` header and the router's
`manual` policy keeps it sticky instead.

`KvAdmission` (`engine.admission=kv`) reserves prompt + capped decode tokens against a worker's KV capacity
(`max_total_num_tokens` from the server's `/server_info`) times `headroom` before a generation starts;
a request that does not fit waits (FIFO per worker) until others release, at most `max_wait_s`, then
starts anyway and is counted. A request larger than the whole budget starts alone. Behind smg
the client does not learn which worker serves a key, so admission reserves against the pool's summed
capacity (one budget). Not done here: SGLang's own scheduler still decides the batch; this only keeps the
client from sending more than the cache holds. Admission of whole agent sessions (`engine.admission=program`) is
`program_admission.py`.

`WorkerLoad.checked` reads one server at start (`/health`, `/model_info`, `/server_info`): its KV capacity.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.engine.sglang.wire import SglangError

log = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "x-smg-routing-key"
"""smg's header for sticky routing under `--policy manual`."""


def block_hashes(ids: Sequence[int], block: int) -> list[int]:
    """Chained hashes of `ids` at every full `block` boundary (the k-th covers ids[:k*block])."""
    out: list[int] = []
    chained = 0
    for start in range(0, len(ids) - block + 1, block):
        chained = hash((chained, tuple(ids[start:start + block])))
        out.append(chained)
    return out


def exact_hash(ids: Sequence[int], block: int, blocks: list[int]) -> int:
    """Hash of all of `ids` (the full blocks' chain plus the tail), distinct from every boundary hash."""
    tail = tuple(ids[len(blocks) * block:])
    return hash(("exact", blocks[-1] if blocks else 0, tail))


class Affinity:
    """Routing keys by shared token prefix (see the module); one instance per engine."""

    def __init__(self, block: int = 16, max_keys: int = 100_000) -> None:
        if block < 1:
            raise ValueError(f"affinity block must be >= 1, got {block}")
        self.block = block
        self.max_keys = max_keys
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._counter = itertools.count()

    def key_for(self, ids: Sequence[int]) -> str:
        """The key of the request `ids` continues or repeats, else a new key; registers `ids` as sent."""
        blocks = block_hashes(ids, self.block)
        exact = exact_hash(ids, self.block, blocks)
        key = self._owner.get(exact) or next((self._owner[h] for h in reversed(blocks) if h in self._owner), None)
        key = key or f"k{next(self._counter)}"
        self._put(exact, key)
        return key

    def finished(self, ids: Sequence[int], output: Sequence[int], key: str) -> None:
        """Register prompt + output of a finished generation, so the session's next turn finds `key`."""
        blocks = block_hashes(list(ids) + list(output), self.block)
        if blocks:
            self._put(blocks[-1], key)

    def _put(self, digest: int, key: str) -> None:
        self._owner[digest] = key
        self._owner.move_to_end(digest)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)


@dataclass
class WorkerLoad:
    """One worker's share of the client's traffic (`WorkerPool`, `KvAdmission`)."""

    url: str
    capacity: int = 0
    """KV tokens the server reports (`max_total_num_tokens`); 0 when unknown."""
    reserved: int = 0
    """Tokens reserved by admitted generations of this client."""
    in_flight: int = 0
    """Generations sent and not yet answered."""
    keys: int = 0
    """Routing keys assigned to this worker (client-side routing)."""
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)
    """Admission waiters, first come first served."""

    @classmethod
    async def checked(cls, call: Callable[..., Awaitable[Any]], url: str, infos: dict[str, dict[str, Any]]
                      ) -> WorkerLoad:
        """Health, model and server info of one server (`call`: `SglangEngine._call`); its `/server_info` goes into
        `infos`, its KV capacity (`max_total_num_tokens`) into the worker it returns."""
        try:
            await call("GET", url, "/health", expect_json=False)
            model = await call("GET", url, "/model_info")
            info = await call("GET", url, "/server_info")
        except SglangError as error:
            raise SglangError(f"engine.urls: {error}") from None
        if not model.get("is_generation", True):
            raise SglangError(f"SGLang server {url} serves an embedding/reward model ({model.get('model_path')}), "
                              "not a generation model")
        infos[url] = info
        capacity = int(info.get("max_total_num_tokens") or 0)
        log.info("sglang server %s: version %s, model %s, KV capacity %d tokens", url, info.get("version"),
                 model.get("model_path"), capacity)
        return cls(url, capacity)


class WorkerPool:
    """Sticky key → worker assignment for the client-side routing (no smg)."""

    def __init__(self, workers: Sequence[WorkerLoad], max_keys: int = 100_000) -> None:
        if not workers:
            raise ValueError("WorkerPool needs at least one worker")
        self.workers = list(workers)
        self.max_keys = max_keys
        self._sticky: OrderedDict[str, WorkerLoad] = OrderedDict()

    def pick(self, key: str) -> WorkerLoad:
        """The worker of `key`: where it went before, else the least loaded one."""
        worker = self._sticky.get(key)
        if worker is None:
            worker = min(self.workers, key=lambda w: (w.reserved, w.in_flight, w.keys))
            worker.keys += 1
            self._sticky[key] = worker
            while len(self._sticky) > self.max_keys:
                self._sticky.popitem(last=False)[1].keys -= 1
        self._sticky.move_to_end(key)
        return worker


class KvAdmission:
    """Reserve KV tokens per worker before a generation starts (see the module)."""

    def __init__(self, headroom: float = 0.9, max_wait_s: float = 300.0) -> None:
        if not 0 < headroom <= 1:
            raise ValueError(f"engine.kv_headroom={headroom} must lie in (0, 1]")
        if max_wait_s <= 0:
            raise ValueError(f"engine.admission_max_wait_s={max_wait_s} must be positive")
        self.headroom = headroom
        self.max_wait_s = max_wait_s
        self.wait_s = 0.0
        """Seconds requests waited for admission since the last `take_metrics`."""
        self.waits = 0
        """Requests that waited since the last `take_metrics`."""
        self.timeouts = 0
        """Requests that started after `max_wait_s` without room since the last `take_metrics`."""
        self.peak_reserved = 0
        """Most tokens reserved at once (all workers) since the last `take_metrics`."""
        self._workers: list[WorkerLoad] = []

    def budget(self, worker: WorkerLoad) -> int:
        """Tokens this worker may hold reserved at once."""
        return int(worker.capacity * self.headroom)

    async def reserve(self, worker: WorkerLoad, tokens: int) -> None:
        """Wait until `tokens` fit in `worker`'s budget (or `max_wait_s` passed), then reserve them."""
        if worker not in self._workers:
            self._workers.append(worker)
        if self._fits(worker, tokens):
            worker.reserved += tokens
        else:
            await self._wait(worker, tokens)
        self.peak_reserved = max(self.peak_reserved, sum(w.reserved for w in self._workers))

    def release(self, worker: WorkerLoad, tokens: int) -> None:
        """Return `tokens` to `worker` and wake the first waiter."""
        worker.reserved -= tokens
        self._wake(worker)

    def take_metrics(self) -> dict[str, float]:
        """`engine/kv_reserved` (peak tokens reserved), `engine/admission_wait_s` (total wait) and counts since
        the last call; resets them."""
        metrics = {"engine/kv_reserved": float(self.peak_reserved), "engine/admission_wait_s": self.wait_s,
                   "engine/admission_waits": float(self.waits), "engine/admission_timeouts": float(self.timeouts)}
        self.peak_reserved = sum(w.reserved for w in self._workers)
        self.wait_s, self.waits, self.timeouts = 0.0, 0, 0
        return metrics

    def _fits(self, worker: WorkerLoad, tokens: int) -> bool:
        """Room for a new arrival: it never overtakes a waiter."""
        return self._room(worker, tokens) and (worker.reserved == 0 or not worker.waiting)

    def _room(self, worker: WorkerLoad, tokens: int) -> bool:
        if worker.capacity <= 0 or worker.reserved == 0:
            return True  # unknown capacity, or alone: a request larger than the budget starts by itself
        return worker.reserved + tokens <= self.budget(worker)

    async def _wait(self, worker: WorkerLoad, tokens: int) -> None:
        """Queue until woken with room, then reserve; a woken request without room waits again at the head."""
        started = time.monotonic()
        self.waits += 1
        front = False
        try:
            while True:
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                (worker.waiting.appendleft if front else worker.waiting.append)(waiter)
                left = self.max_wait_s - (time.monotonic() - started)
                try:
                    await asyncio.wait_for(waiter, timeout=max(left, 0.0))
                except TimeoutError:
                    self.timeouts += 1
                    worker.reserved += tokens
                    return
                finally:
                    if waiter in worker.waiting:
                        worker.waiting.remove(waiter)
                if self._room(worker, tokens):
                    worker.reserved += tokens
                    return
                front = True
        finally:
            self.wait_s += time.monotonic() - started
            self._wake(worker)  # admitted: others may fit too; cancelled: pass on a wake-up it may have had

    @staticmethod
    def _wake(worker: WorkerLoad) -> None:
        """Wake the first waiter (it checks for room itself)."""
        for waiter in worker.waiting:
            if not waiter.done():
                waiter.set_result(None)
                return
