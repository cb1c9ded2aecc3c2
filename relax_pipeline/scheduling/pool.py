"""GroupPool: the resident groups of a run, shared by every runtime strategy.

The pool starts groups under the resident capacity (`runtime.concurrency` slots, held through Prepare and Runtime
and released before Reward, so a finished, dropped or filtered group frees its slot at once), gives each of its
runtime groups a `GroupLease` (`stages.group.runtime_groups`: the whole group when the credit needs it whole,
`credit=group_rm`; one lease per session, with no barrier to wait at, under an ordinary reward), and hands finished
groups back one at a time, in completion order. A group is launched leased (a runtime group generates as soon as its
first-request barrier passes) or held (prelaunch: its agents run, its requests wait); `grant_all`, `revoke_all` and
`cancel_all` act on every resident group. Groups survive across steps until a strategy collects or cancels them.
Once the pipeline is stopping (`Pipeline.interrupt`: the run's first SIGINT/SIGTERM), a group that gets a slot
starts nothing and is not collected. The pool does not score groups and does not decide how many to start:
strategies do (`scheduling/sync.py`, `scheduling/fully_async.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from relax_pipeline.engine.base import Engine
from relax_pipeline.forest.export import Exported
from relax_pipeline.stages.group import INFRA_ERROR, Group, drop_group, runtime_groups
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.turn.leases import GroupLease

log = logging.getLogger(__name__)
Outcome = tuple[Group, dict[str, list[Exported]]]


@dataclass(eq=False)
class _Resident:
    """One launched group: its task, and its group and leases (one per runtime group) once Prepare opened it."""

    leased: bool
    task: asyncio.Task[Outcome | None] | None = None
    group: Group | None = None
    leases: list[GroupLease] = field(default_factory=list)


@dataclass
class GroupPool:
    """Resident groups with their leases; strategies call its methods from the event loop."""

    pipeline: Pipeline
    engine: Engine
    capacity: int
    max_aborted_count: int = 2
    barrier_warn_s: float = 60.0
    on_done: Callable[[], None] = lambda: None
    """Called whenever a resident group's agents have all finished (strategies refill here)."""
    _slots: asyncio.Semaphore = field(init=False)
    _resident: list[_Resident] = field(default_factory=list)
    _ready: deque[Outcome] = field(default_factory=deque)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.capacity)

    @property
    def pending(self) -> int:
        """Groups launched and not yet collected (waiting for a slot, running, or finished)."""
        return len(self._resident) + len(self._ready)

    @property
    def resident(self) -> int:
        """Launched groups whose agents have not all finished (opened or waiting for a slot)."""
        return len(self._resident)

    @property
    def running(self) -> list[Group]:
        """Opened groups whose agents have not all finished."""
        return [r.group for r in self._resident if r.group is not None]

    def launch(self, rollout_id: int, leased: bool = True) -> None:
        """Start one group when a slot is free; `leased=False` holds its requests until `grant_all`."""
        entry = _Resident(leased)
        entry.task = asyncio.ensure_future(self._run(entry, rollout_id))
        entry.task.add_done_callback(lambda task: self._finished(entry, task))
        self._resident.append(entry)

    async def _run(self, entry: _Resident, rollout_id: int) -> Outcome | None:
        async with self._slots:
            if self.closing or self.pipeline.stopped:
                return None
            group = await self.pipeline.start_group(rollout_id, on_open=lambda g: self._attach(entry, g))
            return group, await self.pipeline.await_group(group)

    def _attach(self, entry: _Resident, group: Group) -> None:
        store = self.pipeline.prepare.store
        entry.group = group
        for members in runtime_groups(group, self.pipeline.whole_groups):
            lease = GroupLease(members, store, self.engine, self.max_aborted_count, self.barrier_warn_s)
            for session in members.sessions:
                store.attach_lease(session, lease)
            entry.leases.append(lease)
            if entry.leased:
                lease.grant()

    def _finished(self, entry: _Resident, task: asyncio.Task[Outcome | None]) -> None:
        self._resident.remove(entry)
        error = None if task.cancelled() else task.exception()
        if error is None and not task.cancelled() and (outcome := task.result()) is not None:
            self._ready.append(outcome)
        elif error is not None:
            log.error("group %s failed inside the pipeline", entry.group.id if entry.group else "?", exc_info=error)
            if entry.group is not None:  # record it as dropped, with the reason, rather than lose it
                reason = f"internal error: {type(error).__name__}: {error}"
                drop_group(self.pipeline.prepare.store, entry.group, reason, outcome=INFRA_ERROR)  # before collection
                asyncio.ensure_future(self.pipeline.cancel_group(entry.group, reason))
                self._ready.append((entry.group, {}))
        self._wake.set()
        self.on_done()

    async def next_done(self) -> Outcome | None:
        """The next finished group (oldest first); None when nothing is resident."""
        while not self._ready:
            if not self._resident:
                return None
            self._wake.clear()
            await self._wake.wait()
        return self._ready.popleft()

    def grant_all(self) -> int:
        """Lease every resident group (held or parked); returns how many were not leased before."""
        count = 0
        for entry in self._resident:
            count += not entry.leased
            entry.leased = True
            for lease in entry.leases:
                if not lease.granted:
                    lease.grant()
        return count

    async def revoke_all(self) -> int:
        """Park every resident group, aborting in-flight generations; returns how many were aborted."""
        for entry in self._resident:
            entry.leased = False
        leases = [lease for e in self._resident for lease in e.leases if lease.granted]
        return sum(await asyncio.gather(*(lease.revoke() for lease in leases)))

    async def cancel_all(self, reason: str) -> list[Outcome]:
        """End every resident and finished group with `reason`; returns them (for their dropped rows)."""
        self.closing = True
        entries = list(self._resident)
        await asyncio.gather(*(self.pipeline.cancel_group(e.group, reason) for e in entries if e.group))
        await asyncio.gather(*(e.task for e in entries if e.task), return_exceptions=True)
        await asyncio.sleep(0)  # let the tasks' done callbacks move their outcomes to the ready queue
        ready = list(self._ready)
        self._ready.clear()
        for group, _ in ready:
            await self.pipeline.cancel_group(group, reason)
        self.closing = False
        return ready
