"""`debug.replay_bundle=true`: one replay bundle per recorded step, written by the step loop after the step.

`StepRecorder.record` lays out what the step produced (`format.md` documents every file): the dump rows, each
scored group's credit inputs and outputs, the trainer batch as trained (the credited rows with their base
advantage, in training order), the step's metrics, the composed config (the run's `config.yaml`), the code
version, and sha256 references to the checkpoint before the step (the previous step's folder; for step 0 the
model folder) and after it (when one was written). The folder is written under a temporary name and renamed,
so a bundle is whole or absent. A file already hashed (the checkpoint after step n is the one before step n+1)
is not hashed again.

What it does not do: decide when a step ends or checkpoints (the loop), read bundles (`format.py`) or replay them
(`job.py`). Image tensors of vision-language rows are not recorded (their rows' sizes are).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from relax_pipeline.credit.records import CreditContext
from relax_pipeline.forest.sample import Sample
from relax_pipeline.replay import format as fmt
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import StepResult

CHECKPOINT_FILES = ("model.safetensors", "adapter_model.safetensors", "optimizer.pt", "trainer_state.pt")
"""The files of a checkpoint folder that a reference hashes (those present)."""


class StepRecorder:
    """Writes `<output>/replay/step_<n>/` for the chosen steps; connects the step loop to the bundle format."""

    def __init__(self, output_dir: Path, steps: Sequence[int] | None, model_path: Path | None) -> None:
        self.output_dir = Path(output_dir)
        self.steps = None if steps is None else set(steps)
        """The steps that get a bundle; None: every step."""
        self.model_path = model_path
        """The weights before step 0 (the run's model folder)."""
        self._hashes: dict[tuple[str, int, int], str] = {}

    def wants(self, step: int) -> bool:
        return self.steps is None or step in self.steps

    def record(self, step: int, result: StepResult, samples: Sequence[Sample], metrics: dict[str, float],
               checkpoints: Path | None) -> Path:
        """Write step `step`'s bundle; returns its folder."""
        folder = self.output_dir / "replay" / f"step_{step}"
        tmp = folder.with_name(f".{folder.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rows = _write_rows(tmp / fmt.ROWS, result.rows)
        _write_lines(tmp / fmt.CREDIT, [_group_line(g, rows) for g in result.groups if g.contexts])
        write_batch(tmp, samples, _identities(result.groups))
        (tmp / fmt.METRICS).write_text(json.dumps(metrics, indent=1, sort_keys=True))
        if (self.output_dir / "config.yaml").is_file():
            shutil.copyfile(self.output_dir / "config.yaml", tmp / fmt.CONFIG)
        (tmp / fmt.MANIFEST).write_text(json.dumps(self._manifest(step, len(samples), checkpoints), indent=1))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    def _manifest(self, step: int, samples: int, checkpoints: Path | None) -> dict[str, Any]:
        before = checkpoints / f"step_{step}" if checkpoints is not None else None
        if (before is None or not before.is_dir()) and step == 0:
            before = self.model_path
        after = checkpoints / f"step_{step + 1}" if checkpoints is not None else None
        return {"format_version": fmt.FORMAT_VERSION, "step": step, "written_at": time.time(),
                "code_version": code_version(), "model_path": str(self.model_path) if self.model_path else None,
                "samples": samples, "checkpoint_before": self._reference(before),
                "checkpoint_after": self._reference(after)}

    def _reference(self, folder: Path | None) -> dict[str, Any] | None:
        """{path, sha256: {file: digest}} of a checkpoint folder; None when there is none."""
        if folder is None or not folder.is_dir():
            return None
        files = {name: self._sha256(folder / name) for name in CHECKPOINT_FILES if (folder / name).is_file()}
        return {"path": str(folder.resolve()), "sha256": files} if files else None

    def _sha256(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = sha256_of(path)
        return self._hashes[key]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def code_version() -> dict[str, str | None]:
    """The package's version and `git describe` of its checkout (None when not a git checkout)."""
    try:
        package = importlib.metadata.version("relax_pipeline")
    except importlib.metadata.PackageNotFoundError:
        package = None
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=False)
        git = done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git = None
    return {"package": package, "git": git}


def _write_lines(path: Path, lines: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line, ensure_ascii=False, default=str) + "\n" for line in lines))


def _write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> dict[tuple[Any, ...], int]:
    """Write the dump rows; returns (group, session, name, branch) → line of every row with tokens (a filtered
    or failed session's row has none)."""
    _write_lines(path, rows)
    return {(r["group_id"], r["session_id"], r.get("name"), r.get("branch")): i for i, r in enumerate(rows)
            if r.get("tokens")}


def _group_line(group: Group, rows: dict[tuple[Any, ...], int]) -> dict[str, Any]:
    return {"group_id": group.id, "mode": group.mode, "slots": len(group.sessions), "filtered": group.filtered,
            "dropped": group.dropped, "contexts": [_context(group, c, rows) for c in group.contexts]}


def _context(group: Group, c: CreditContext, rows: dict[tuple[Any, ...], int]) -> dict[str, Any]:
    """A context's credit inputs and outputs; its sample by its row's line, or inline when it has no row."""
    row = rows.get((group.id, c.session_id, c.name, c.branch))
    line = {"slot": c.slot, "session_id": c.session_id, "name": c.name, "branch": c.branch,
            "truncated_failure": c.truncated_failure, "metadata": c.metadata, "prompt": c.prompt,
            "exported_reward": c.exported_reward, "reward_object": c.reward_object, "reward": c.reward,
            "advantage": c.advantage, "row": row}
    if row is None:
        line["sample"] = sample_dict(c.sample)
    return line


def sample_dict(sample: Sample) -> dict[str, Any]:
    """The fields of a sample that credit and the trainer read, as JSON values."""
    return {"tokens": list(sample.tokens), "prompt_length": sample.prompt_length, "loss_mask": list(sample.loss_mask),
            "rollout_logprobs": list(sample.rollout_logprobs), "weight_versions": list(sample.weight_versions),
            "truncated": sample.truncated, "messages": [m.to_openai(inline_media=False) for m in sample.messages]}


def _identities(groups: Sequence[Group]) -> dict[int, dict[str, Any]]:
    """id(sample) → where a credited sample came from (group, slot, session, name, branch)."""
    return {id(c.sample): {"group_id": g.id, "slot": c.slot, "session_id": c.session_id, "name": c.name,
                           "branch": c.branch} for g in groups for c in g.contexts}


def write_batch(folder: Path, samples: Sequence[Sample], identities: dict[int, dict[str, Any]]) -> None:
    """`batch.safetensors` (the rows' tensors, concatenated) and `batch.jsonl` (each row's identity)."""
    _write_lines(folder / fmt.BATCH_INDEX, [identities.get(id(s), {}) for s in samples])
    if not samples:
        return
    token_offsets = np.cumsum([0] + [len(s.tokens) for s in samples], dtype=np.int64)
    response_offsets = np.cumsum([0] + [s.response_length for s in samples], dtype=np.int64)
    tensors = {
        "tokens": np.array([t for s in samples for t in s.tokens], dtype=np.int64), "token_offsets": token_offsets,
        "prompt_length": np.array([s.prompt_length for s in samples], dtype=np.int64),
        "loss_mask": np.array([m for s in samples for m in s.loss_mask], dtype=np.int8),
        "rollout_logprobs": np.array([x for s in samples for x in s.rollout_logprobs], dtype=np.float64),
        "weight_versions": np.array([v for s in samples for v in _versions(s)], dtype=np.int64),
        "response_offsets": response_offsets,
        "advantage": np.array([s.advantage for s in samples], dtype=np.float64),
    }
    save_file(tensors, str(folder / fmt.BATCH))
    (folder / fmt.BATCH).chmod(0o644)  # safetensors writes it private; the bundle's other files are not


def _versions(sample: Sample) -> list[int]:
    """One weight version per response token (-1 where the sample records none)."""
    versions = list(sample.weight_versions)
    return versions if len(versions) == sample.response_length else [-1] * sample.response_length
