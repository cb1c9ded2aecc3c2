"""Group leases: when a group's model calls may generate, and how they are preempted.

A `GroupLease` sits between the gateway and the engine for every session of one group:

- **First-request barrier.** No session of the group generates until every session has sent its first
  request (or ended); while the barrier waits longer than `warn_s`, the missing sessions are logged (too
  few external agent slots show up this way).
- **Lease.** Requests are held while the group holds no lease: a prelaunched group (`grant` not yet
  called) or a group parked between steps (`revoke`). The sessions' agent timers run only while the
  lease is held (`agent.timeout` is active time), and session states follow: `waiting` before the first
  grant, `running` while leased, `parked` after a revoke.
- **Preemption.** `revoke` aborts every in-flight generation through the engine; the turn service sees
  the abort was ours (`Flight.preempted`) and resumes the same request, with the partial tokens appended
  to its prompt, once the lease is granted again. A request already aborted `max_aborted_count` times is
  protected: `revoke` waits for it to finish instead.

The lease knows nothing of steps or strategies (`scheduling/pool.py` and the strategies decide when to
grant and revoke) and nothing of protocols (the gateway turns `LeaseClosed` into a 404).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from relax_pipeline.engine.base import Engine
from relax_pipeline.turn.errors import LeaseClosed
from relax_pipeline.turn.sessions import ForestStore, Session, Status

log = logging.getLogger(__name__)


class ActiveClock(Protocol):
    """An agent's active-time budget as the lease drives it (`agent.launcher.ActiveTimer` is one)."""

    @property
    def started(self) -> bool:
        """True once the agent's clock was started (by the stage that started the agent)."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class AgentRun(Protocol):
    """One session's agent, wherever it runs; connects the stages (start, wait, terminate) and the group lease
    (`timer`) to an executor. Declared here, by its lowest consumer: `agent/executors.py`'s `AgentProcess`,
    `HttpAgent` and `RayAgent` satisfy it without importing it."""

    @property
    def timer(self) -> ActiveClock:
        """The active-time budget (`agent.timeout`); paused while the group lease is not held."""
        ...

    @property
    def pid(self) -> int | None:
        """The local process (group) id; None before start and for agents that run elsewhere."""
        ...

    @property
    def returncode(self) -> int | None:
        """The agent's exit code once known, None while it runs."""
        ...

    async def start(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Launch the agent with the session's RELAX_* variables; its log goes to `io_dir/agent.log`."""
        ...

    async def wait(self) -> object:
        """Wait under the active timer; `AgentFailure` unless the agent exits 0 (the result is the executor's)."""
        ...

    async def terminate(self) -> None:
        """End the agent and everything it started; idempotent."""
        ...

    def kill(self) -> None:
        """End it at once without waiting (the run's last resort before exiting)."""
        ...

    def tail(self) -> str:
        """The end of the agent's log."""
        ...


class Members(Protocol):
    """What a lease needs of its group (`stages.group.Group` is one): the sessions and their agents."""

    id: str
    sessions: list[Session]
    processes: dict[str, AgentRun]
    """Agent (a local process or an agent-server session) by session id; none before its agent starts."""


@dataclass(eq=False)
class Flight:
    """One generation in flight under a lease; connects the turn service's resume loop to `revoke`."""

    rid: str
    aborts: int
    """How often this request was already aborted and resumed."""
    preempted: bool = False
    """Set by `revoke` before it aborts the generation: the abort was ours, resume it later."""
    done: asyncio.Event = field(default_factory=asyncio.Event)


class _Signal:
    """Wakes every waiter when something about the lease changed (grant, revoke, arrival, exit)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def pulse(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None) -> None:
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass


class GroupLease:
    """Barrier, lease and preemption for the sessions of one group."""

    def __init__(self, group: Members, store: ForestStore, engine: Engine, max_aborted_count: int = 2,
                 warn_s: float = 60.0) -> None:
        self.group = group
        self.store = store
        self.engine = engine
        self.max_aborted_count = max_aborted_count
        self.warn_s = warn_s
        self.granted = False
        self.flights: dict[str, Flight] = {}
        self._arrived: set[str] = set()
        self._changed = _Signal()
        self._warned_at = 0.0

    # -- strategy side -------------------------------------------------------------------------------

    def grant(self) -> None:
        """Let the group generate: held requests go on and the agents' active-time clocks run."""
        self.granted = True
        for session in self._live():
            self.store.set_status(session, Status.RUNNING)
            if (process := self.group.processes.get(session.id)) and process.timer.started:
                process.timer.resume()  # a process still starting is paused or not by Prepare afterwards
        self._changed.pulse()

    async def revoke(self) -> int:
        """Park the group: abort in-flight generations (protected ones finish first); returns aborts."""
        self.granted = False
        self._pause(Status.PARKED)
        aborted = 0
        for flight in list(self.flights.values()):
            if flight.aborts >= self.max_aborted_count:
                await flight.done.wait()
                continue
            flight.preempted = True
            aborted += await self.engine.abort(flight.rid) is not None
        return aborted

    def _pause(self, status: Status) -> None:
        for session in self._live():
            self.store.set_status(session, status)
            if process := self.group.processes.get(session.id):
                process.timer.pause()
        self._changed.pulse()

    def notify(self) -> None:
        """A session exited or failed: the barrier may be complete now."""
        self._changed.pulse()

    def count_abort(self, session: Session) -> None:
        """One of `session`'s generations was preempted by `revoke` and will resume."""
        self.store.count_abort(session)

    # -- gateway side --------------------------------------------------------------------------------

    @asynccontextmanager
    async def generation(self, session: Session, rid: str, aborts: int) -> AsyncIterator[Flight]:
        """Wait for the barrier and the lease, then hold a `Flight` while the engine generates `rid`."""
        self._arrived.add(session.id)
        self._changed.pulse()
        await self._wait_open(session)
        flight = Flight(rid, aborts)
        self.flights[rid] = flight
        try:
            yield flight
        finally:
            self.flights.pop(rid, None)
            flight.done.set()

    async def _wait_open(self, session: Session) -> None:
        since = time.monotonic()
        while not (self.granted and self._barrier_done()):
            if session.status.terminal:
                raise LeaseClosed(f"session {session.id} is {session.status.value}; its request was not served")
            await self._changed.wait(self.warn_s)
            now = time.monotonic()
            if self.granted and now - since >= self.warn_s and now - self._warned_at >= self.warn_s:
                self._warned_at = now
                self._warn_missing(now - since)

    def _barrier_done(self) -> bool:
        return all(s.id in self._arrived or s.status.terminal or s.status is Status.EXITED
                   for s in self.group.sessions)

    def missing(self) -> list[Session]:
        """Sessions the first-request barrier is still waiting for."""
        return [s for s in self.group.sessions
                if s.id not in self._arrived and not s.status.terminal and s.status is not Status.EXITED]

    def _warn_missing(self, waited: float) -> None:
        names = ", ".join(f"{s.id} (index {s.index})" for s in self.missing())
        log.warning("group %s: first-request barrier has waited %.0f s for %s; each session's agent must send "
                    "its first model request (too few agent slots on an external platform?)",
                    self.group.id, waited, names)

    def _live(self) -> list[Session]:
        return [s for s in self.group.sessions if not s.status.terminal and s.status is not Status.EXITED]
