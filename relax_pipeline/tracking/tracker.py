"""Trackers: where per-step metrics go besides run.log.

`NullTracker` is `tracking=none`: the same interface, doing nothing, so the pipeline never branches on
whether tracking is on. The W&B tracker is `tracking/wandb.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Tracker(Protocol):
    def start(self, config: Mapping[str, Any]) -> None: ...
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class NullTracker:
    """A tracker that records nothing; takes the same settings as the W&B tracker."""

    def __init__(self, project: str = "relax_pipeline", entity: str | None = None, name: str | None = None,
                 mode: str | None = None, output_dir: str | None = None) -> None:
        self.project = project

    def start(self, config: Mapping[str, Any]) -> None:
        return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def finish(self) -> None:
        return None
