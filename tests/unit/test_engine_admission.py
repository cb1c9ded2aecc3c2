"""The embedded engine's admission rule: arrivals while a batch decodes are gathered, not prefilled one by one."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from relax_pipeline.engine.hf.engine import ADMIT_AFTER_STEPS, _Scheduler


def due(waiting: int, active: int, room: int, waited: int) -> bool:
    """Whether `_Scheduler._admission_due` admits: `waiting` queued (the oldest for `waited` steps)."""
    queue = deque(SimpleNamespace(queued_at=100 - waited) for _ in range(waiting))
    state = SimpleNamespace(waiting=queue, batch=SimpleNamespace(rows=[object()] * active),
                            engine=SimpleNamespace(stats={"steps": 100}))
    return _Scheduler._admission_due(state, room)  # type: ignore[arg-type]


def test_an_idle_engine_admits_at_once() -> None:
    assert due(waiting=1, active=0, room=32, waited=0)


def test_a_lone_arrival_waits_for_company_a_few_decode_steps() -> None:
    assert not due(waiting=1, active=10, room=22, waited=0)
    assert not due(waiting=1, active=10, room=22, waited=ADMIT_AFTER_STEPS - 1)
    assert due(waiting=1, active=10, room=22, waited=ADMIT_AFTER_STEPS)


def test_enough_arrivals_are_admitted_together_at_once() -> None:
    assert due(waiting=5, active=10, room=22, waited=0)
    assert not due(waiting=4, active=10, room=22, waited=0)
    assert due(waiting=1, active=30, room=2, waited=0), "a quarter of a small room is one request"


def test_nothing_to_admit_or_no_room() -> None:
    assert not due(waiting=0, active=0, room=32, waited=0)
    assert not due(waiting=3, active=32, room=0, waited=10)
