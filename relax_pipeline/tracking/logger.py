"""Trackers: where per-step metrics go besides run.log.

`NullTracker` is `tracking=none`: the same interface, doing nothing, so the pipeline never branches on
whether tracking is on. The W&B tracker lands with the training issue.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Tracker(Protocol):
    def start(self, config: Mapping[str, Any]) -> None: ...
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class NullTracker:
    """A tracker that records nothing."""

    def __init__(self, project: str = "relax_pipeline") -> None:
        self.project = project

    def start(self, config: Mapping[str, Any]) -> None:
        return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def finish(self) -> None:
        return None
