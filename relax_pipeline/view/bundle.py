"""A replay bundle opened directly in the viewer: `job=view view.dir=<output>/replay/step_<n>`.

A bundle folder (`relax_pipeline/replay/format.md`: `bundle.json`, `rows.jsonl`, `credit.jsonl`, `metrics.json`,
...) is one step of a run. `BundleFolder` gives the viewer what a run folder would: the step's dump rows
(`rows.jsonl` is a dump file, so the session list and session pages work unchanged), its metrics as a one-step
curve set, and a summary for the bundle page: the manifest (format version, code version, checkpoint
references), the loss and train metrics, and the credit per group and context (reward, advantage, whether the
group was filtered, which dump row holds the context's tokens).

The manifest is read with `replay/format.py`'s reader, so a bundle of another format version is refused with the
reader's message. This module only reads; the bundle is written by `replay/recorder.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relax_pipeline.replay import format as fmt

SUMMARY_METRICS = ("train/loss", "train/pg_loss", "train/grad_norm", "train/kl", "train/ppo_kl", "train/entropy",
                   "train/weight_version", "train/version_lag/mean", "rollout/raw_reward")
"""The metrics the bundle page shows first (the rest follow by name)."""


def is_bundle(folder: Path) -> bool:
    return (folder / fmt.MANIFEST).is_file()


class BundleFolder:
    """One replay bundle folder as the viewer reads it (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.manifest = fmt.read_manifest(root)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def rows_path(self) -> Path:
        return self.root / fmt.ROWS

    def brief(self) -> dict[str, Any]:
        return {"step": self.step, "format_version": self.manifest["format_version"]}

    def metrics(self) -> dict[str, float]:
        path = self.root / fmt.METRICS
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def curves(self) -> dict[str, list[tuple[int, float]]]:
        """Every metric as a one-point curve at the bundle's step."""
        return {key: [(self.step, float(value))] for key, value in sorted(self.metrics().items())
                if isinstance(value, int | float)}

    def summary(self) -> dict[str, Any]:
        """What the bundle page shows: manifest, metrics (summary ones first) and the credit per group."""
        metrics = self.metrics()
        order = [k for k in SUMMARY_METRICS if k in metrics] + sorted(k for k in metrics if k not in SUMMARY_METRICS)
        return {"folder": str(self.root), "manifest": self.manifest, "metrics": [[k, metrics[k]] for k in order],
                "groups": [credit_group(line) for line in fmt.read_jsonl(self.root / fmt.CREDIT)]}


def credit_group(line: dict[str, Any]) -> dict[str, Any]:
    """A `credit.jsonl` line without the inputs the page does not show (prompts, metadata, inline samples)."""
    contexts = [{key: c.get(key) for key in ("slot", "session_id", "name", "branch", "exported_reward", "reward",
                                             "advantage", "truncated_failure", "row")}
                for c in line.get("contexts", [])]
    return {"group_id": line.get("group_id"), "mode": line.get("mode"), "slots": line.get("slots"),
            "filtered": line.get("filtered"), "dropped": line.get("dropped"), "contexts": contexts}
