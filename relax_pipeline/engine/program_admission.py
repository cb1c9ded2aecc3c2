"""Program-aware admission (`engine.admission=program`): a whole agent session is admitted against the KV the
engine can hold, by its predicted use, before its turns are sent; on both engines.

`ProgramLedger` keeps one lease per admitted agent session (a "program"): the tokens it is predicted to hold,
`max(start + growth, context + this turn's max_new_tokens)`, where `start` is its context when first admitted
and `growth` the tokens a finished session of the same task added past its start (`GrowthModel`: an EWMA per
task, the EWMA over all tasks for a task not seen finishing yet, `prior` before any session finished). The
task of a session is a hash of its first prompt's token ids (the samples of one prompt, in this step and the
next ones, share it; the engine never sees prompt ids). A new session is admitted when its prediction fits
next to the leases held, `max(leased, load) + predicted <= capacity * headroom` (`load`: the tokens the engine
reports in use, when it reports them); otherwise it waits in one global FIFO (no later arrival overtakes it)
until leases end, at most `max_wait_s`, then starts anyway (counted). A session alone starts whatever its
size. An admitted session's later turns never wait: its lease only grows to what they may hold.

Leases end when the session ends (`end`, from `Engine.close_session`: the session's final context teaches
the growth model) or when the session sat idle (no turn in flight) for `lease_s` seconds: a dead or stuck
agent cannot hold room forever; such a session waits in the FIFO again at its next turn. The KV model is
SGLang's dereference-then-evict, not free: an open session's KV is referenced (with `--enable-session-radix-cache`;
eviction takes unreferenced KV first), an ended session's KV is only dereferenced and stays cached until eviction
needs its room; so an ended lease counts as free room (SGLang evicts that KV for whoever needs it) and the load
read from `/metrics` (`sglang:num_used_tokens`) excludes it too. Without the flag an open session's KV is ordinary
cache: its lease is then a prediction the ledger keeps room for, not KV SGLang protects. Capacity unknown
(0: SGLang reported no `max_total_num_tokens`, the embedded engine runs without a prefix cache) admits
everything (fail-open), logged once and reported as `agentic_kv/fail_open`.

`ProgramAdmission` puts the ledger in front of an engine's own `generate`: a turn with a `session_id` waits
for its session's admission, then generates; a turn without one (no agent session) passes straight through.
`abort` of a turn still waiting ends it with an empty "abort" result. Metrics (`take_metrics`, per step):
`agentic_kv/admitted`, `waiting` (most at once), `wait_s`, `timeouts`, `expired`, `leased_tokens`,
`capacity`, `load_tokens`, `fail_open`, and for the sessions that ended `predicted_tokens` / `actual_tokens`
(means).

The engines' numbers: engine=sglang sets `capacity` to its servers' summed `max_total_num_tokens` and reads
their load, summed, from SGLang's Prometheus `/metrics` (`sglang:num_used_tokens`: tokens held by running
requests, evictable cache excluded; served with `--enable-metrics`) at most once a second while sessions wait
for admission (`sglang_load`); without metrics the ledger counts its own leases only (logged once,
`agentic_kv/load_tokens` 0). engine=hf sets `capacity` to its prefix cache in tokens (`hf_capacity_tokens`).

Not done here: choosing the worker, per-request KV admission (`sglang.routing.KvAdmission`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.settings import ProgramPart

log = logging.getLogger(__name__)
Load = Callable[[], Awaitable[int | None]]
"""Tokens the engine reports in use now; None when it cannot say."""


def task_key(prompt: Sequence[int]) -> str:
    """The task of a session: a digest of its first prompt's token ids."""
    return hashlib.blake2b(repr(tuple(prompt)).encode(), digest_size=8).hexdigest()


class GrowthModel:
    """Expected growth (final context minus the context at admission) per task: an EWMA of finished sessions."""

    def __init__(self, prior: int, alpha: float = 0.3, max_tasks: int = 100_000) -> None:
        self.prior, self.alpha, self.max_tasks = prior, alpha, max_tasks
        self._tasks: OrderedDict[str, float] = OrderedDict()
        self._overall: float | None = None

    def expected(self, task: str) -> int:
        """The task's EWMA; the overall one for an unseen task; `prior` before any session finished."""
        value = self._tasks.get(task, self._overall)
        return self.prior if value is None else round(value)

    def learn(self, task: str, growth: int) -> None:
        """A session of `task` ended `growth` tokens past its start."""
        self._tasks[task] = self._ewma(self._tasks.get(task), growth)
        self._tasks.move_to_end(task)
        self._overall = self._ewma(self._overall, growth)
        while len(self._tasks) > self.max_tasks:
            self._tasks.popitem(last=False)

    def _ewma(self, old: float | None, sample: int) -> float:
        return float(sample) if old is None else (1 - self.alpha) * old + self.alpha * sample


@dataclass
class Program:
    """One agent session as the ledger sees it."""

    task: str
    start: int
    """Context tokens at its first admission."""
    predicted: int
    """Tokens predicted at its first admission (reported against `context` when it ends)."""
    context: int
    """Its latest known context: prompt + output of its last turn."""
    tokens: int = 0
    """Tokens its lease holds now; 0 when it holds none (not admitted yet, or expired)."""
    in_flight: int = 0
    idle_since: float = 0.0


class ProgramLedger:
    """Leases of admitted sessions against the engine's KV capacity (see the module)."""

    def __init__(self, headroom: float, max_wait_s: float, lease_s: float, prior: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.headroom, self.max_wait_s, self.lease_s = headroom, max_wait_s, lease_s
        self.growth = GrowthModel(prior)
        self.clock = clock
        self.capacity = 0
        """KV tokens the engine can hold (set by the engine at start); 0: unknown (fail-open)."""
        self.load: int | None = None
        """Tokens the engine reported in use at the last reading; None: it does not report them."""
        self.reader: Load | None = None
        """Reads the engine's load (set by the engine at start); None: leases only."""
        self._read_at = float("-inf")
        self.programs: dict[str, Program] = {}
        self._queue: deque[tuple[str, int, asyncio.Future[None]]] = deque()
        self._counts: dict[str, float] = {}
        self._warned = False
        self._reset()

    @property
    def leased(self) -> int:
        return sum(p.tokens for p in self.programs.values())

    @property
    def budget(self) -> int:
        return int(self.capacity * self.headroom)

    def predict(self, program: Program, context: int, cap: int) -> int:
        return max(program.start + self.growth.expected(program.task), context + cap)

    async def admit(self, session_id: str, prompt: Sequence[int], cap: int) -> None:
        """Wait until session `session_id` (this turn: `prompt`, up to `cap` new tokens) holds a lease."""
        self.expire()
        program = self.programs.get(session_id)
        if program is None:
            program = Program(task_key(prompt), len(prompt), 0, len(prompt))
            program.predicted = self.predict(program, len(prompt), cap)
            self.programs[session_id] = program
        if program.tokens == 0:
            await self._read_load()
            await self._queued(session_id, program, self.predict(program, len(prompt), cap))
        program.tokens = max(program.tokens, self.predict(program, len(prompt), cap))
        program.in_flight += 1

    def turn_done(self, session_id: str, context: int | None) -> None:
        """A turn of `session_id` ended holding `context` tokens (None: it failed); its idle clock starts."""
        program = self.programs.get(session_id)
        if program is None:
            return
        program.in_flight = max(program.in_flight - 1, 0)
        program.idle_since = self.clock()
        if context is not None:
            program.context = context
            program.tokens = max(program.tokens, context) if program.tokens else 0

    def end(self, session_id: str) -> None:
        """Session `session_id` ended: its lease is released and its growth learned."""
        program = self.programs.pop(session_id, None)
        if program is None:
            return
        self.growth.learn(program.task, max(program.context - program.start, 0))
        self._count("ended", 1)
        self._count("predicted", program.predicted)
        self._count("actual", program.context)
        self._wake()

    def expire(self) -> None:
        """Release the leases of sessions idle (no turn in flight) for `lease_s` seconds."""
        now = self.clock()
        for program in self.programs.values():
            if program.tokens and not program.in_flight and now - program.idle_since >= self.lease_s:
                program.tokens = 0
                self._count("expired", 1)
        self._wake()

    def take_metrics(self) -> dict[str, float]:
        """The `agentic_kv/*` metrics since the last call (see the module); resets the counts."""
        c, ended = self._counts, self._counts["ended"]
        metrics = {"agentic_kv/admitted": c["admitted"], "agentic_kv/waiting": c["waiting"],
                   "agentic_kv/wait_s": c["wait_s"], "agentic_kv/timeouts": c["timeouts"],
                   "agentic_kv/expired": c["expired"], "agentic_kv/leased_tokens": float(self.leased),
                   "agentic_kv/capacity": float(self.capacity), "agentic_kv/load_tokens": float(self.load or 0),
                   "agentic_kv/fail_open": float(self.capacity <= 0),
                   "agentic_kv/predicted_tokens": c["predicted"] / ended if ended else 0.0,
                   "agentic_kv/actual_tokens": c["actual"] / ended if ended else 0.0}
        self._reset()
        return metrics

    def fits(self, tokens: int) -> bool:
        """Room for `tokens` more next to the leases held (and the engine's reported load)."""
        if self.capacity <= 0:
            if not self._warned:
                self._warned = True
                log.warning("engine.admission=program: the engine reports no KV capacity; every session is "
                            "admitted at once (fail-open, agentic_kv/fail_open=1)")
            return True
        held = max(self.leased, self.load or 0)
        return held == 0 or held + tokens <= self.budget

    async def _queued(self, session_id: str, program: Program, tokens: int) -> None:
        """Admit at once when nobody waits and it fits, else wait in the FIFO (`max_wait_s` at most)."""
        if not self._queue and self.fits(tokens):
            return self._admitted(program, tokens)
        started = self.clock()
        entry = (session_id, tokens, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        self._count("waiting", len(self._queue), peak=True)
        try:
            await self._wait(entry[2], started)
        finally:
            if entry in self._queue:  # timed out, or cancelled while waiting
                self._queue.remove(entry)
            self._count("wait_s", self.clock() - started)
            self._wake()
        if program.tokens == 0:  # let in after max_wait_s
            self._admitted(program, tokens)

    async def _wait(self, waiter: asyncio.Future[None], started: float) -> None:
        """Until `_wake` admits this waiter, looking for expired leases now and then; after `max_wait_s` the
        waiter goes in anyway (counted in `timeouts`)."""
        while not waiter.done():
            left = self.max_wait_s - (self.clock() - started)
            if left <= 0:
                self._count("timeouts", 1)
                return
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout=min(left, max(self.lease_s / 4, 0.05)))
            except TimeoutError:
                self.expire()

    async def _read_load(self, every_s: float = 1.0) -> None:
        """Read the engine's load when the last reading is older than `every_s` (a wall-clock interval)."""
        if self.reader is None or time.monotonic() - self._read_at < every_s:
            return
        self._read_at = time.monotonic()
        self.load = await self.reader()
        if self.load is None:
            log.warning("engine.admission=program: the engine reports no load; admission counts its own leases only")
            self.reader = None

    def _admitted(self, program: Program, tokens: int) -> None:
        program.tokens, program.idle_since = tokens, self.clock()
        self._count("admitted", 1)

    def _wake(self) -> None:
        """Admit the queue's head while it fits (FIFO: the others wait behind it)."""
        while self._queue:
            session_id, tokens, waiter = self._queue[0]
            program = self.programs.get(session_id)
            if program is not None and not waiter.done():
                if not self.fits(tokens):
                    return
                self._admitted(program, tokens)
            self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _count(self, name: str, value: float, peak: bool = False) -> None:
        self._counts[name] = max(self._counts[name], value) if peak else self._counts[name] + value

    def _reset(self) -> None:
        self._counts = dict.fromkeys(("admitted", "waiting", "wait_s", "timeouts", "expired", "ended",
                                      "predicted", "actual"), 0.0)
        self._counts["waiting"] = float(len(self._queue))  # still waiting: counted in the next step too


GenerateCall = Callable[[], Awaitable[GenerateResult]]


class ProgramAdmission:
    """The ledger in front of an engine's `generate` (see the module); one per engine."""

    @classmethod
    def built(cls, part: ProgramPart | None, version: Callable[[], int]) -> ProgramAdmission | None:
        """The admission `engine.admission=program` asks for (`part`); None for another admission."""
        if part is None:
            return None
        return cls(ProgramLedger(part.headroom, part.max_wait_s, part.lease_s, part.growth_prior), version)

    def __init__(self, ledger: ProgramLedger, version: Callable[[], int]) -> None:
        self.ledger = ledger
        self.version = version
        """The engine's weight version (for the "abort" result of a turn aborted while waiting)."""
        self._waiting: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()

    async def generate(self, call: GenerateCall, prompt: Sequence[int], sampling: SamplingParams, rid: str,
                       session_id: str | None) -> GenerateResult:
        """`call()` once session `session_id` is admitted; its turn is recorded in the ledger."""
        if session_id is None:
            return await call()
        if not await self._admitted(session_id, prompt, sampling.max_new_tokens, rid):
            return GenerateResult((), (), "abort", self.version())
        context: int | None = None
        try:
            result = await call()
            context = len(prompt) + len(result.output_ids)
            return result
        finally:
            self.ledger.turn_done(session_id, context)

    def abort(self, rid: str) -> GenerateResult | None:
        """End turn `rid` if it still waits for admission (its `generate` returns "abort"); None otherwise."""
        waiting = self._waiting.get(rid)
        if waiting is None or waiting.done():
            return None
        self._aborted.add(rid)
        waiting.cancel()
        return GenerateResult((), (), "abort", self.version())

    def watch(self, capacity: int, load: Load | None = None) -> None:
        """The engine's KV capacity in tokens (0: unknown, fail-open) and its load reader (None: leases only)."""
        self.ledger.capacity, self.ledger.reader = capacity, load
        if capacity <= 0:
            self.ledger.fits(0)  # says once that admission is open

    def end(self, session_id: str) -> None:
        """Session `session_id` ended (`Engine.close_session`): its lease goes."""
        self.ledger.end(session_id)

    def take_metrics(self) -> dict[str, float]:
        return self.ledger.take_metrics()

    async def _admitted(self, session_id: str, prompt: Sequence[int], cap: int, rid: str) -> bool:
        """Wait for admission; False when `abort(rid)` ended the wait."""
        task = asyncio.ensure_future(self.ledger.admit(session_id, prompt, cap))
        self._waiting[rid] = task
        try:
            await task
            return True
        except asyncio.CancelledError:
            if rid in self._aborted and task.cancelled():
                return False
            raise
        finally:
            self._waiting.pop(rid, None)
            self._aborted.discard(rid)


def hf_capacity_tokens(model: Any, cache_bytes: int) -> int:
    """KV tokens a prefix cache of `cache_bytes` holds for a transformers `model` (keys and values, every layer,
    in the dtype of its weights)."""
    config = getattr(model.config, "text_config", None) or model.config
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    size = next(model.parameters()).element_size()
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * size
    return cache_bytes // per_token if per_token > 0 else 0


def prometheus_sum(text: str, name: str) -> float | None:
    """The sum of every sample of metric `name` in Prometheus text; None when it has none."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")]
    return sum(values) if values else None


def sglang_load(call: Callable[..., Awaitable[Any]], urls: Sequence[str]) -> Load:
    """The load reader of SGLang servers: `sglang:num_used_tokens` of every server's `/metrics`, summed; None
    when a server does not serve them (started without `--enable-metrics`)."""
    async def read() -> int | None:
        total = 0.0
        for url in urls:
            try:
                value = prometheus_sum(await call("GET", url, "/metrics", expect_json=False), "sglang:num_used_tokens")
            except RuntimeError as error:  # SglangError: no metrics route
                log.info("engine.admission=program: %s/metrics unreadable: %s", url, error)
                return None
            if value is None:
                return None
            total += value
        return int(total)
    return read
