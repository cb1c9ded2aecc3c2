"""The eval curve is drawn from eval.csv, one line per dataset, into eval_curve.png."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_pipeline.stages.evaluate import append_eval_csv
from relax_pipeline.tracking.plot import curves, plot_eval_curve


def test_the_curve_has_one_point_per_eval_and_is_drawn(tmp_path: Path) -> None:
    for step, value in [(0, 0.12), (4, 0.44), (8, 0.57)]:
        path = append_eval_csv(tmp_path, step, "heldout", {"eval/heldout/raw_reward": value,
                                                           "eval/heldout/num_turns/mean": 1.0})
    assert curves(path) == {"heldout": [(0, 0.12), (4, 0.44), (8, 0.57)]}
    pytest.importorskip("matplotlib")
    png = plot_eval_curve(path)
    assert png == tmp_path / "eval_curve.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
