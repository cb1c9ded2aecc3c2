"""The pool's agent slots are counted in sessions: a group takes a group's worth when it starts and gives each slot
back as that session's agent is done, so the next group starts while a finished group's slowest session still runs.

A stand-in pipeline (`_Pipeline`: `start_group` and `await_group` only, sessions ended by the test) drives the real
`GroupPool`; the lease side (`on_open`) is not exercised here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from relax_pipeline.scheduling.pool import AgentSlots, GroupPool

pytestmark = pytest.mark.asyncio


@dataclass
class _Group:
    id: int
    ends: list[asyncio.Future[None]]
    excluded: bool = False


@dataclass
class _Prepare:
    n_samples: int


@dataclass
class _Pipeline:
    """Groups whose sessions end when the test says (`end(group, session)`)."""

    group_size: int
    stopped: str | None = None
    groups: list[_Group] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prepare = _Prepare(self.group_size)

    async def start_group(self, rollout_id: int, on_open: Callable[[Any], None] | None = None) -> _Group:
        loop = asyncio.get_running_loop()
        group = _Group(len(self.groups), [loop.create_future() for _ in range(self.group_size)])
        self.groups.append(group)
        return group

    async def await_group(self, group: _Group, on_session_end: Callable[[Any], None] | None = None) -> dict:
        for done in asyncio.as_completed(group.ends):
            await done
            if on_session_end is not None:
                on_session_end(None)
        return {}

    def end(self, group: int, session: int) -> None:
        self.groups[group].ends[session].set_result(None)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_group_starts_once_a_groups_worth_of_sessions_ended_across_groups() -> None:
    pipeline = _Pipeline(group_size=2)
    pool = GroupPool(pipeline, engine=None, capacity=2)  # type: ignore[arg-type]  # 4 agent slots
    for _ in range(3):
        pool.launch(0)
    await _settle()
    assert len(pipeline.groups) == 2 and pool.room == 0, "two groups' worth of slots: the third waits"
    pipeline.end(0, 0)
    await _settle()
    assert len(pipeline.groups) == 2, "one free slot is not a group's worth"
    pipeline.end(1, 1)
    await _settle()
    assert len(pipeline.groups) == 3, "one session of each group ended: the third group starts"
    for group, session in ((0, 1), (1, 0), (2, 0), (2, 1)):
        pipeline.end(group, session)
    outcomes = [await pool.next_done() for _ in range(3)]
    assert sorted(g.id for g, _ in outcomes) == [0, 1, 2] and pool.room == 2 and pool.pending == 0


async def test_slots_given_back_wake_the_waiter_that_fits() -> None:
    slots = AgentSlots(2)
    await slots.take(2)
    waiter = asyncio.ensure_future(slots.take(2))
    await _settle()
    slots.give(1)
    await _settle()
    assert not waiter.done()
    slots.give(1)
    await _settle()
    assert waiter.done() and slots.free == 0


async def test_a_cancelled_waiter_takes_nothing() -> None:
    slots = AgentSlots(1)
    await slots.take(1)
    waiter = asyncio.ensure_future(slots.take(1))
    await _settle()
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    slots.give(1)
    assert slots.free == 1
