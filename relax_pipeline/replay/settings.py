"""The `replay` node (`ReplaySettings`, `job=replay`'s input) and the `debug` node (`DebugSettings`: the rollout
dump and the replay bundles a run writes), as records.

`DebugSettings` makes what the step loop writes with: the rollout dump (`tracking/dump.py`) and, with
`debug.replay_bundle=true`, the `StepRecorder` of the chosen steps. `replay/job.py`'s `replay_run` turns a
`ReplaySettings` into what `job=replay` re-runs, checking the folder first. Nothing here reads a bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relax_pipeline.replay.recorder import StepRecorder
from relax_pipeline.tracking.dump import RolloutDump


@dataclass
class ReplaySettings:
    """The `replay` node; connects `job=replay`'s command line to `replay/job.py`."""

    bundle: str | None = None
    """The bundle folder to replay (`<output>/replay/step_<n>`, written with debug.replay_bundle=true)."""
    checkpoint: str | None = None
    """The checkpoint folder from before the step; null: the one the bundle names (its sha256 is checked)."""


@dataclass
class DebugSettings:
    """The `debug` node; connects the config to the rollout dump and the step loop's replay bundles."""

    save_rollout_data: str | None = None
    """Dump path containing {rollout_id}; relative paths resolve in the run's output folder."""
    replay_bundle: bool = False
    """Write a replay bundle per train step under `<output>/replay/step_<n>/` (`relax_pipeline/replay/format.md`):
    rows, credit inputs and outputs, the trainer batch, metrics, config, code version, checkpoint hashes."""
    replay_steps: list[int] | None = None
    """With replay_bundle=true: the steps (0-based) that get a bundle; null: every step."""

    def dump(self, output_dir: Path) -> RolloutDump:
        """The run's rollout dump (`debug.save_rollout_data`; none when it is null)."""
        return RolloutDump(self.save_rollout_data, output_dir)

    def recorder(self, output_dir: Path, model_path: Path) -> StepRecorder | None:
        """The writer of the chosen steps' replay bundles; None with `debug.replay_bundle=false`."""
        return StepRecorder(output_dir, self.replay_steps, model_path) if self.replay_bundle else None
