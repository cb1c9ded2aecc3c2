"""`runtime=sync` keeps its over-sampling margin while it replaces rejected groups (`SyncRuntime._in_flight`)."""

from __future__ import annotations

from types import SimpleNamespace

from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.scheduling.sync import SyncRuntime


def in_flight(need: int, over_sampling: int | None, accepted: int) -> int:
    runtime = SyncRuntime(RuntimeSettings())
    runtime.binding = SimpleNamespace(over_sampling=over_sampling)  # type: ignore[assignment]
    return runtime._in_flight(need, accepted)


def test_the_margin_shrinks_with_the_groups_still_missing() -> None:
    assert [in_flight(8, 12, a) for a in (0, 4, 7, 8)] == [12, 6, 2, 0]


def test_without_over_sampling_exactly_the_missing_groups_run() -> None:
    assert [in_flight(4, None, a) for a in (0, 1, 3, 4)] == [4, 3, 1, 0]
