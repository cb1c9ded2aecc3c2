"""`tracking=wandb`: the run's config and per-step metrics in Weights & Biases.

Without `WANDB_API_KEY` (or with `tracking.mode=offline`) W&B runs offline and writes the run under
`<output folder>/wandb/`, so tracking works on a closed network; `wandb sync <that folder>` uploads it
later. `finish` is always called (the run calls it in a `finally`). W&B is imported only when this
tracker is chosen: it is the optional `wandb` extra.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from relax_pipeline.tracking.tracker import TrackingSettings

MODES = ("online", "offline", "disabled")


class WandbTracker:
    """Logs to W&B with the same interface as `NullTracker`."""

    def __init__(self, settings: TrackingSettings, output_dir: str | None = None) -> None:
        mode = settings.mode
        try:
            import wandb
        except ImportError as error:
            raise ValueError("tracking=wandb needs the wandb package: pip install 'relax_pipeline[wandb]'") from error
        if mode is not None and mode not in MODES:
            raise ValueError(f"tracking.mode={mode!r}; choose one of {list(MODES)}")
        self._wandb = wandb
        self.project, self.entity, self.name = settings.project, settings.entity, settings.name
        self.mode = mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.output_dir = output_dir
        self._run: Any = None

    def start(self, config: Mapping[str, Any]) -> None:
        self._run = self._wandb.init(project=self.project, entity=self.entity, name=self.name, mode=self.mode,
                                     dir=self.output_dir, config=dict(config), reinit="finish_previous")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
