"""Trackers: where per-step metrics go besides run.log.

`TrackingSettings` is the `tracking` node (its `traces` and `otlp_endpoint` keys are read by the recipes for
`tracking/traces.py`, and its `console` and `console_metrics` keys by the console, `tracking/console.py`, whatever
the tracker). `NullTracker` is `tracking=none`: the same interface, doing
nothing, so the pipeline never branches on whether tracking is on. The W&B tracker is `tracking/wandb.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_pipeline.tracking.console import CONSOLE_METRICS, HEADLINE, check_console


@dataclass
class TrackingSettings:
    """The `tracking` group's node; connects the config to the tracker its `_target_` names."""

    _target_: str = "relax_pipeline.tracking.tracker.NullTracker"
    """The tracker class (`tracking=none`: this module's NullTracker; `tracking=wandb`: tracking/wandb.py)."""
    project: str = "relax_pipeline"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account default."""
    name: str | None = None
    """Run name; None lets W&B choose."""
    mode: str | None = None
    """online, offline or disabled; None means offline unless WANDB_API_KEY is set."""
    traces: bool = True
    """One OpenTelemetry trace per session, as OTLP JSON lines in `<output_dir>/traces/step_<n>.jsonl`
    (tracking/traces.py); false writes none."""
    otlp_endpoint: str | None = None
    """Also export the traces to this OTLP/HTTP endpoint (`http://host:4318`, `/v1/traces` added when no path is
    given); needs opentelemetry-exporter-otlp-proto-http (`pip install 'relax_pipeline[otlp]'`)."""
    console: str = HEADLINE
    """What the console shows per step: `headline`, one line of `console_metrics` with the time per step and the ETA
    (the full `step N metrics` line and the per-step AGENTIC lines stay in run.log); `full`, every line run.log gets,
    each step's headline after its line."""
    console_metrics: list[str] = field(default_factory=lambda: list(CONSOLE_METRICS))
    """The headline's metrics, in order, each `label:metric` or a bare metric name (labelled by its path less the first
    segment); a `*` stands for one path segment and its match joins the label (`eval:eval/*/raw_reward` shows `eval
    heldout 0.74`); a metric the step lacks is left out."""

    def __post_init__(self) -> None:
        check_console(self.console, self.console_metrics)


class Tracker(Protocol):
    def start(self, config: Mapping[str, Any]) -> None: ...
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class NullTracker:
    """A tracker that records nothing; takes the same settings as the W&B tracker."""

    def __init__(self, settings: TrackingSettings, output_dir: str | None = None) -> None:
        self.project = settings.project

    def start(self, config: Mapping[str, Any]) -> None:
        return None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def finish(self) -> None:
        return None
