"""`trainer.keep_freed_memory` (train/allocator.py): when a trainer keeps freed CPU memory mapped.

Only the decision is tested here; whether malloc really keeps a freed buffer resident needs a fresh interpreter
per case (the setting is process-wide), so that test is in `tests/integration/test_allocator.py`. The
`TrainingThread` runs every call on one thread of its own, or on the caller's when disabled.
"""

from __future__ import annotations

import os
import threading

import pytest

from relax_pipeline.train.allocator import TrainingThread, wants_freed_memory_kept


def test_null_means_on_for_the_cpu_only() -> None:
    assert wants_freed_memory_kept(None, "cpu") and not wants_freed_memory_kept(None, "cuda:0")
    assert not wants_freed_memory_kept(False, "cpu") and wants_freed_memory_kept(True, "cuda")


def test_a_training_thread_runs_every_call_on_one_thread_and_nested_calls_in_place() -> None:
    thread = TrainingThread(enabled=True)
    idents = {thread.run(threading.get_ident) for _ in range(4)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert thread.run(thread.run, threading.get_ident) in idents, "a call from the thread itself runs in place"
    with pytest.raises(ValueError, match="bad"):
        thread.run(int, "bad")
    thread.close()
    assert TrainingThread(enabled=False).run(threading.get_ident) == threading.get_ident()


def test_kernel_cache_cap_leaves_a_users_value(monkeypatch) -> None:  # noqa: ANN001 - pytest's fixture
    from relax_pipeline.train.allocator import (
        IDEEP_CACHE_VARIABLE,
        KERNEL_CACHE,
        KERNEL_CACHE_VARIABLE,
        cap_kernel_cache,
    )

    for name in (KERNEL_CACHE_VARIABLE, IDEEP_CACHE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    assert cap_kernel_cache()
    assert os.environ[KERNEL_CACHE_VARIABLE] == os.environ[IDEEP_CACHE_VARIABLE] == str(KERNEL_CACHE)
    monkeypatch.setenv(KERNEL_CACHE_VARIABLE, "8")
    monkeypatch.delenv(IDEEP_CACHE_VARIABLE)
    assert cap_kernel_cache(), "the unset one is still capped"
    assert os.environ[KERNEL_CACHE_VARIABLE] == "8" and os.environ[IDEEP_CACHE_VARIABLE] == str(KERNEL_CACHE)
    monkeypatch.setenv(IDEEP_CACHE_VARIABLE, "9")
    assert not cap_kernel_cache() and os.environ[IDEEP_CACHE_VARIABLE] == "9"
