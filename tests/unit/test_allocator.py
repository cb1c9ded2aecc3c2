"""`trainer.keep_freed_memory` (train/allocator.py): when a trainer keeps freed CPU memory mapped.

Only the decision is tested here; whether malloc really keeps a freed buffer resident needs a fresh interpreter
per case (the setting is process-wide), so that test is in `tests/integration/test_allocator.py`.
"""

from __future__ import annotations

from relax_pipeline.train.allocator import wants_freed_memory_kept


def test_null_means_on_for_the_cpu_only() -> None:
    assert wants_freed_memory_kept(None, "cpu") and not wants_freed_memory_kept(None, "cuda:0")
    assert not wants_freed_memory_kept(False, "cpu") and wants_freed_memory_kept(True, "cuda")
