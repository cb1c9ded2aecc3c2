"""The optimizer: the `trainer.optim` node (`OptimSettings`), the AdamW built from it, and one clipped step.

Both backends build their optimizer with `adamw` (DeepSpeed receives it in `deepspeed.initialize`); the
torch backend steps it with `clip_and_step`, DeepSpeed clips with its own `gradient_clipping`.

What this module does not do: learning-rate schedules, warm-up, other optimizers, or mixed precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class OptimSettings:
    """The `trainer.optim` node; connects the `trainer` config group to the backends' optimizer.

    Not frozen: OmegaConf turns frozen dataclasses into read-only nodes, which overrides could not change.
    """

    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        for key in ("lr", "weight_decay", "grad_clip"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"trainer.optim.{key}={value}; use a finite number >= 0"
                                 + (" (0 disables clipping)" if key == "grad_clip" else ""))


FUSED_DEVICES = ("cpu", "cuda")
"""Devices with torch's fused AdamW kernel."""


def adamw(params: Iterable[torch.nn.Parameter], settings: OptimSettings) -> torch.optim.AdamW:
    """torch's AdamW with the configured learning rate and weight decay, fused where every parameter allows it.

    The fused kernel updates each tensor in one pass: the default multi-tensor path makes a parameter-sized
    temporary (the square root of the second moment) and, for SmolLM2 on this CPU, took 1.6-2.3 s a step against
    0.23-0.29 s fused. Both compute the same update; the order of floating-point operations differs.
    """
    params = list(params)
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, fused=fused or None)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip to `grad_clip` (0: no clipping, the norm is still measured), step, zero the gradients.

    Returns the global gradient norm before clipping.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    limit = grad_clip if grad_clip > 0 else float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
