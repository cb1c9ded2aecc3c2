"""TrainerSpec: the training hyperparameters of the `trainer` config group.

Only the record lives here; the loss pipeline and the torch/DeepSpeed backends that consume it land
with the training issue, and until then `job=train` refuses to start with that sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS: tuple[str, ...] = ("torch", "deepspeed")


@dataclass(frozen=True)
class TrainerSpec:
    """Trainer choice and optimizer settings; connects the config to a training backend."""

    backend: str = "torch"
    lr: float = 1e-3
    global_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"trainer.backend={self.backend!r}; choose one of {list(BACKENDS)}")
