"""`metrics.jsonl` in the output folder: every metrics dict the run logs, one JSON line each, as it is logged.

`MetricsFile` wraps the configured tracker (`tracking=none` or W&B) and appends one line
`{"step": N, "time": unix_s, "metrics": {name: value}}` per `log` call before passing the call on, so a
reader (the run viewer) sees each step's metrics while the run is still going. Step metrics and eval
metrics (`eval/<name>/...`, logged with the number of steps done) are both lines. Lines are flushed at
once; a reader skips a torn last line. `read_metrics_file` is the reader. This module formats nothing for
people: run.log keeps the human-readable `step N metrics ...` lines.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relax_pipeline.tracking.tracker import Tracker

METRICS_FILE = "metrics.jsonl"


class MetricsFile:
    """A tracker that appends every logged metrics dict to `<output_dir>/metrics.jsonl`, then calls `inner`."""

    def __init__(self, inner: Tracker, output_dir: Path) -> None:
        self.inner = inner
        self.path = Path(output_dir) / METRICS_FILE

    def start(self, config: Mapping[str, Any]) -> None:
        self.inner.start(config)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values = {key: float(value) for key, value in metrics.items() if math.isfinite(float(value))}
        line = json.dumps({"step": int(step), "time": round(time.time(), 3), "metrics": values})
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
        self.inner.log(metrics, step)

    def finish(self) -> None:
        self.inner.finish()


def read_metrics_file(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) per complete line of a `metrics.jsonl`, in file order; a torn last line is skipped."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        out.append((int(record["step"]), dict(record["metrics"])))
    return out
