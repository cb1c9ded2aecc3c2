"""GroupPool: the resident groups of a run, shared by every runtime strategy.

The pool starts groups under the resident capacity, counted in agent slots: `runtime.concurrency` groups'
worth (`× rollout.n_samples_per_prompt` sessions). A group takes one slot per session when it starts and gives each
back as that session's agent is done, the rest before Reward, so a group waiting for its slowest session holds one
slot, not the whole group's, and the next group starts as soon as a group's worth is free (a finished, dropped or
filtered group frees everything at once). Gives each of its
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
    held: int = 0
    """Agent slots it holds: one per session whose agent is not done yet, 0 while it waits for its slots."""


class AgentSlots:
    """The pool's agent slots, one per live session; a group takes a group's worth at once (first come, first
    served among waiters that fit) and gives them back one by one."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._changed = asyncio.Event()

    async def take(self, count: int) -> None:
        """Wait until `count` slots are free and take them."""
        while self.free < count:
            self._changed.clear()
            await self._changed.wait()
        self.free -= count

    def give(self, count: int) -> None:
        self.free += count
        self._changed.set()


@dataclass
class GroupPool:
    """Resident groups with their leases; strategies call its methods from the event loop."""

    pipeline: Pipeline
    engine: Engine
    capacity: int
    max_aborted_count: int = 2
    barrier_warn_s: float = 60.0
    on_done: Callable[[], None] = lambda: None
    """Called whenever agent slots free up: a session's agent is done, a resident group finished (strategies
    refill here)."""
    _slots: AgentSlots = field(init=False)
    _resident: list[_Resident] = field(default_factory=list)
    _ready: deque[Outcome] = field(default_factory=deque)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    closing: bool = False

    def __post_init__(self) -> None:
        self.group_size = self.pipeline.prepare.n_samples
        """Sessions of a train group (`rollout.n_samples_per_prompt`): the slots a group takes."""
        self._slots = AgentSlots(self.capacity * self.group_size)

    @property
    def pending(self) -> int:
        """Groups launched and not yet collected (waiting for a slot, running, or finished)."""
        return len(self._resident) + len(self._ready)

    @property
    def resident(self) -> int:
        """Launched groups whose agents have not all finished (opened or waiting for a slot)."""
        return len(self._resident)

    @property
    def ready(self) -> int:
        """Finished groups not collected yet."""
        return len(self._ready)

    @property
    def room(self) -> int:
        """Groups that would start at once if launched now: free slots not promised to launched groups still
        waiting for theirs, in groups' worth."""
        waiting = sum(1 for r in self._resident if r.held == 0 and r.group is None)
        return max(0, self._slots.free // self.group_size - waiting)

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
        await self._slots.take(self.group_size)
        entry.held = self.group_size
        try:
            if self.closing or self.pipeline.stopped:
                return None
            group = await self.pipeline.start_group(rollout_id, on_open=lambda g: self._attach(entry, g))
            return group, await self.pipeline.await_group(group, lambda _: self._give(entry, 1))
        finally:
            self._give(entry, entry.held)

    def _give(self, entry: _Resident, count: int) -> None:
        """`entry` gives back `count` of its slots (a session's agent is done, or the group left the runtime)."""
        count = min(count, entry.held)
        if count > 0:
            entry.held -= count
            self._slots.give(count)
            self.on_done()

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
