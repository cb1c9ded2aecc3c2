"""The loss stage of a replay: the step's training re-run on a CPU from the checkpoint before it.

`checkpoint_for` finds the weights the step started from (the folder `replay.checkpoint` names, else the one the
bundle names) and checks its `model.safetensors` (under `trainer.lora` its `adapter_model.safetensors`: the
trainer is built over the run's base model with the bundle's `trainer.lora`) against the bundle's sha256, so a
replay never silently runs from other weights. `train_step` builds `trainer=torch` on the CPU from the bundle's
`trainer` node (`torch_keys`: keys only DeepSpeed reads are left out, one process computes the same step), loads
that checkpoint (weights, optimizer state, version) and trains the given rows once, returning the step's `train/...`
metrics. `batch_samples` reads the recorded trainer batch back.

Tolerances: the loss is expected bit-exact on the same CPU build (`LOSS_RTOL` applies when it is not, and the
report says so); the gradient norm is a sum over every parameter whose reduction order may differ between thread
counts and builds, so it is compared within `GRAD_NORM_RTOL`.

A `trainer=deepspeed` step replays on this one torch process from its checkpoint's `model.safetensors`; DeepSpeed's
own optimizer files are not read, so only a step's first global batch is exact (the default: one per step).

What it does not do: several ranks or a GPU; images (vision-language rows are not in the bundle).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from relax_pipeline.credit.settings import AdvantageSettings
from relax_pipeline.forest.sample import Sample
from relax_pipeline.models.adapter_folder import ADAPTER_WEIGHTS
from relax_pipeline.replay import format as fmt
from relax_pipeline.replay.credit import Key
from relax_pipeline.replay.recorder import sha256_of
from relax_pipeline.train.settings import TrainerRun, TrainerSettings
from relax_pipeline.train.torch_backend import STATE_FILE, TorchTrainer

LOSS_RTOL = 1e-6
"""Relative tolerance of the replayed loss when it is not bit-exact."""
GRAD_NORM_RTOL = 1e-4
"""Relative tolerance of the replayed gradient norm (before clipping)."""
TORCH_TRAINER = "relax_pipeline.train.torch_backend.TorchTrainer"
WEIGHT_FILES = ("model.safetensors", ADAPTER_WEIGHTS)
"""A checkpoint's weights: the whole model's, or under `trainer.lora` the adapter's (PEFT's file)."""


@dataclass(frozen=True)
class TrainSetup:
    """What the replayed step trains with; connects the bundle's config (turned into records by config.py) to the
    trainer."""

    trainer: TrainerSettings
    """The bundle's `trainer` node as `trainer=torch` on the CPU (`torch_keys`)."""
    seed: int
    temperature: float
    """The rollout's sampling temperature (logprobs are computed as the engine computed them)."""
    advantages: AdvantageSettings


@dataclass(frozen=True)
class Start:
    """The weights a replayed step starts from; connects the bundle's reference to the trainer."""

    checkpoint: Path
    model_path: Path
    """The folder the trainer is built from (the run's model folder when it is still there: its KL reference)."""


def checkpoint_for(manifest: dict[str, Any], given: str | None) -> tuple[Start | None, str]:
    """The checkpoint to replay from and a line saying which (or why there is none)."""
    reference = manifest.get("checkpoint_before")
    if given is None and reference is None:
        return None, ("no checkpoint before this step was saved (set trainer.save_interval=1 to checkpoint every "
                      "step), and replay.checkpoint is unset")
    folder = Path(given or reference["path"]).expanduser()
    weights = next((name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if weights is None:
        return None, f"checkpoint {folder} holds no {' or '.join(WEIGHT_FILES)}; set replay.checkpoint=FOLDER"
    expected = (reference or {}).get("sha256", {}).get(weights)
    found = sha256_of(folder / weights)
    if expected is not None and found != expected:
        return None, (f"checkpoint {folder}/{weights} has sha256 {found[:16]}..., the bundle recorded "
                      f"{expected[:16]}... from before the step: set replay.checkpoint to the matching folder")
    model = Path(manifest["model_path"]) if manifest.get("model_path") else folder
    start = Start(folder, model if (model / "config.json").is_file() else folder)
    note = ("; its optimizer state is DeepSpeed's and is not read (the first global batch's loss and gradient do not "
            "depend on it)") if (folder / "deepspeed").is_dir() and not (folder / "optimizer.pt").is_file() else ""
    return start, f"checkpoint {folder} (sha256 {'matches the bundle' if expected else 'not recorded'}){note}"


def torch_keys(node: dict[str, Any]) -> dict[str, Any]:
    """The bundle's `trainer` node as `trainer=torch` keys on the CPU (keys only DeepSpeed reads left out)."""
    known = {f.name for f in fields(TrainerSettings)}
    kept = {k: v for k, v in node.items() if k in known}
    return {**kept, "_target_": TORCH_TRAINER, "device": "cpu", "keep_freed_memory": False}


def train_step(start: Start, setup: TrainSetup, samples: list[Sample]) -> dict[str, float]:
    """One replayed training step from `start` on `samples`; its metrics."""
    with tempfile.TemporaryDirectory(prefix="relax-replay-") as scratch:
        run = TrainerRun(str(start.model_path), setup.seed, setup.temperature, setup.advantages, scratch, {})
        trainer = TorchTrainer(setup.trainer, run)
        try:
            if (start.checkpoint / STATE_FILE).is_file():
                trainer.load(start.checkpoint)
            return trainer.train(samples)
        finally:
            trainer.close()


def batch_samples(folder: Path) -> list[tuple[Key, Sample]]:
    """The recorded trainer batch as samples (with their advantages) and their contexts, in training order."""
    return [((r.get("group_id"), r.get("slot"), r.get("name"), r.get("branch")),
             Sample(tuple(r["tokens"]), r["prompt_length"], tuple(r["loss_mask"]), tuple(r["rollout_logprobs"]),
                    tuple(v for v in r["weight_versions"] if v >= 0), advantage=r["advantage"]))
            for r in fmt.read_batch(folder)]


def loss_shares(rows: list[tuple[Key, Sample]]) -> dict[Key, float]:
    """Each row's share of the policy-gradient loss at ratio 1: −advantage × its loss tokens / the batch's."""
    total = sum(sum(s.loss_mask) for _, s in rows) or 1
    return {key: -(s.advantage or 0.0) * sum(s.loss_mask) / total for key, s in rows}


def verdict(recorded: float | None, replayed: float | None, rtol: float) -> str:
    """`identical (bit-exact)`, `within rtol=...` or `DIFFERS`, with both values."""
    if recorded is None or replayed is None:
        return f"not comparable (recorded {recorded}, replayed {replayed})"
    if recorded == replayed:
        return f"identical (bit-exact): {replayed!r}"
    gap = abs(recorded - replayed)
    word = "within" if gap <= rtol * max(abs(recorded), 1e-12) else "DIFFERS beyond"
    return f"{word} the tolerance rtol={rtol:g}: recorded {recorded!r}, replayed {replayed!r} (|diff| {gap:.3g})"
