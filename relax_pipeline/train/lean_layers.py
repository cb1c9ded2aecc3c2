"""Leaner activations for a Llama-family policy under autocast: its norms and SwiGLU MLPs keep less for the backward.

Under bf16 autocast with float32 weights, transformers' RMSNorm (Llama, Qwen2, Qwen3, Mistral) keeps both its
float32 input and the float32 normalized state for the backward, and returns float32, which each projection that
reads it casts to bf16 on its own: q, k and v each keep a bf16 copy of the same input, gate and up two more. Its
SwiGLU MLP keeps silu(gate) beside gate and up. What these copies weigh in a SmolLM2 step, and what removing them
saves, is on docs/benchmarks.md ("Training step").

`lean_activations(model)` swaps the forward of each decoder layer's two norms, of the final norm, and of each
SwiGLU MLP for one that, while autocast is on for the input's device:

- norm (`_NormToProjection`): runs transformers' float32 ops in their order and returns the result cast once to
  the autocast dtype, which is exactly what each projection would have cast it to; it keeps the input and the
  per-token reciprocal RMS, and the backward recomputes the normalized state (a few elementwise passes);
- MLP (`_SwiGLU`): silu(gate) * up keeping gate and up only; the backward recomputes silu.

So the forward's logits are bit-identical to the unpatched model's (a test checks), and the gradients agree to
rounding: the backward's elementwise math runs in float32 where autograd ran the MLP's in bf16. Outside autocast
the original forwards run, so float32 training and its exactness tests are untouched. Only the norms whose
output feeds projections alone are swapped: Qwen3's per-head q and k norms feed the rotary embedding and stay.

What it does not do: other norm or MLP shapes (Gemma's 1 + weight, gelu MLPs: left as they are), attention
(models/attention.py's `grouped` kernel keeps its probabilities once, in bf16), or activation checkpointing
(no matmul is recomputed).
"""

from __future__ import annotations

import types
from typing import Any

import torch

NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
"""Norm classes computing transformers' `weight * (x * rsqrt(mean(x^2) + eps))` in float32."""
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
"""MLP classes computing `down(act(gate(x)) * up(x))`; swapped when `act` is one of `SILU`."""
SILU = ("SiLU", "SiLUActivation")
"""Activation classes computing `torch.nn.functional.silu` (torch's, transformers')."""


def lean_activations(model: torch.nn.Module) -> int:
    """Swap the forwards described above on `model` in place; the number of modules swapped."""
    swapped = 0
    for module in model.modules():
        for name in ("input_layernorm", "post_attention_layernorm", "norm"):
            norm = getattr(module, name, None)
            if isinstance(norm, torch.nn.Module) and type(norm).__name__ in NORMS:
                norm.forward = types.MethodType(_norm_forward, norm)
                swapped += 1
        if type(module).__name__ in MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU:
            module.forward = types.MethodType(_mlp_forward, module)
            swapped += 1
    return swapped


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for `x`'s device, or None when autocast is off there."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = _autocast_dtype(hidden_states)
    if dtype is None or hidden_states.dtype != torch.float32:
        return type(self).forward(self, hidden_states)
    return _NormToProjection.apply(hidden_states, self.weight, self.variance_epsilon, dtype)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    if _autocast_dtype(x) is None:
        return type(self).forward(self, x)
    return self.down_proj(_SwiGLU.apply(self.gate_proj(x), self.up_proj(x)))


class _NormToProjection(torch.autograd.Function):
    """transformers' float32 RMSNorm, its output cast to the projections' dtype; keeps input and 1/RMS."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            inverse = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            out = (weight * (x * inverse)).to(dtype)
        ctx.save_for_backward(x, weight, inverse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, inverse = ctx.saved_tensors
        normed = x * inverse
        grad = grad.float()
        grad_weight = (grad * normed).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        scaled = grad * weight
        grad_x = inverse * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        return grad_x, grad_weight, None, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = (t.float() for t in ctx.saved_tensors)
        grad = grad.float()
        sigmoid = torch.sigmoid(gate)
        grad_up = grad * gate * sigmoid
        grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
        dtype = ctx.saved_tensors[0].dtype
        return grad_gate.to(dtype), grad_up.to(dtype)
