"""The eval curve as a picture: `eval_curve.png` beside `eval.csv` in the output folder, redrawn after each eval.

One line per eval dataset of its `raw_reward` (for exact-answer rewards, greedy pass@1) against the steps
trained, drawn with matplotlib's file-only Agg backend. matplotlib is optional (the `test` and `smollm2`
extras install it): without it nothing is drawn and the CSV stays the record. This module reads the CSV
that `stages/evaluate.py` writes and nothing else.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

log = logging.getLogger(__name__)
CURVE_PNG = "eval_curve.png"


def curves(csv_path: Path, metric: str = "raw_reward") -> dict[str, list[tuple[int, float]]]:
    """`metric` per dataset as (step, value) points, in step order."""
    points: dict[str, list[tuple[int, float]]] = {}
    with open(csv_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["metric"] == metric:
                points.setdefault(row["dataset"], []).append((int(row["step"]), float(row["value"])))
    return {name: sorted(line) for name, line in points.items()}


def plot_eval_curve(csv_path: Path, metric: str = "raw_reward") -> Path | None:
    """Draw `metric` of every eval dataset into `eval_curve.png`; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        log.info("matplotlib is not installed: %s is not drawn (pip install matplotlib)", CURVE_PNG)
        return None
    figure, axes = pyplot.subplots(figsize=(6, 4), dpi=100)
    for name, line in curves(csv_path, metric).items():
        axes.plot([s for s, _ in line], [v for _, v in line], marker="o", label=name)
    axes.set(xlabel="training steps", ylabel=f"eval {metric}", ylim=(0, 1), title="held-out eval")
    axes.grid(alpha=0.3)
    axes.legend()
    path = csv_path.parent / CURVE_PNG
    figure.savefig(path, bbox_inches="tight")
    pyplot.close(figure)
    return path
