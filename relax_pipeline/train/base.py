"""The `Trainer` protocol: what the step loop (`loop.py`) asks of a training backend, and nothing else.

The `trainer` config group picks the class (`trainer=torch`: `TorchTrainer`, `trainer=deepspeed`:
`DeepSpeedTrainer`; test doubles such as `testing.engines.PacedTrainer` fit it too). The recipes build it
from the config's records (`LossSettings`, `BatchSettings`, `OptimSettings`) plus the values it must agree
on with the other groups (the rollout temperature and the credit's `AdvantageSettings`).

Contract: `train` runs the optimizer steps of one rollout batch and returns `train/...` and `perf/...`
metrics; every call that trains bumps `version`, the weight version the engine serves next.
`engine_weights` is a detached CPU state dict for `Engine.update_weights`; under `trainer.lora` the sync sends
`engine_adapter` (the adapter alone, `Engine.update_adapter`) instead. `save` writes a checkpoint
folder atomically with the caller's plain `extra` values; the folder is a loadable Hugging Face model folder
(weights, config, generation config, tokenizer, chat template; under `trainer.lora` a PEFT adapter folder in
place of the weights), plus the optimizer state unless the backend was built with `save_optimizer=False`.
`load` restores it (weights, optimizer when saved, version, RNG states) and returns `extra`. `close` releases
what the backend holds (a process group).

What it does not say: how the loss, batching or optimizer work (train/losses.py, batching.py, optim.py),
or when to checkpoint (the loop's `Checkpoints`, from `trainer.save_interval`/`resume`/`checkpoint_dir`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from relax_pipeline.engine.base import AdapterWeights
from relax_pipeline.forest.sample import Sample


@runtime_checkable
class Trainer(Protocol):
    """A policy being trained; connects the step loop to a training backend."""

    version: int
    """Weight version of the current policy: 0 at start, +1 per `train` call that trained."""

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Optimizer steps over one rollout batch; metrics averaged over them. No samples: no step, {}."""
        ...

    def engine_weights(self) -> dict[str, Any]:
        """The policy's weights as a detached CPU state dict (tied weights stay tied)."""
        ...

    def engine_adapter(self) -> AdapterWeights | None:
        """Under `trainer.lora` the adapter the weight sync sends (`Engine.update_adapter`); None: sync
        `engine_weights`."""
        ...

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        """Write a checkpoint folder at `path` atomically (a loadable model folder); `extra` holds plain values."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the checkpoint at `path` (a fresh optimizer when it holds none); returns its `extra`."""
        ...

    def close(self) -> None:
        """Release what the backend holds; safe to call once construction finished."""
        ...
