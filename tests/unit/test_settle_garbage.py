"""`settle_garbage` (loop.py): collects, freezes the survivors, and makes automatic full collections rarer while
leaving the younger generations' thresholds alone; nothing it froze is lost once unfrozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from relax_pipeline.loop import GC_OLDEST_THRESHOLD, settle_garbage


@pytest.fixture
def restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_settle_garbage_collects_freezes_and_spaces_full_collections(restored: None) -> None:
    young, middle, _ = gc.get_threshold()

    class Cycle:
        pass

    dead = Cycle()
    dead.me = dead  # type: ignore[attr-defined]
    gone = weakref.ref(dead)
    alive = [Cycle()]
    del dead
    settle_garbage(full=True)
    assert gone() is None
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (young, middle, GC_OLDEST_THRESHOLD)
    settle_garbage(full=True)
    assert gc.get_threshold() == (young, middle, GC_OLDEST_THRESHOLD)
    gc.unfreeze()
    assert any(o is alive for o in gc.get_objects())
