"""`attn_implementation="grouped"`: eager attention for grouped-query models that never copies the KV cache.

transformers' eager attention first expands every key/value head to the query heads that share it
(`repeat_kv`, a copy of the whole cache of the layer at every call: 3 heads to 9 for SmolLM2), then runs two
batched matmuls. `grouped_attention` instead folds each KV head's group of query heads into the query-length
axis, `[B, H, Q, D] -> [B, KVH, H/KVH * Q, D]`, so the same two matmuls read the cache as it is stored. The
sums are the same (on this CPU the logits equal eager's exactly; a test compares them), and a decode step
reads less memory, more so as the cache grows (docs/benchmarks.md, "Engine").

It trains too (`trainer.attn_implementation=grouped`; against sdpa's CPU flash-attention kernel on
docs/benchmarks.md, "Training step"). The mask is eager's (an additive
float mask `[B, 1, Q, L]`, registered as this implementation's mask function), broadcast over the group.
Keys and values wider than the mask (the embedded engine's decode step hands over its whole KV buffer, a
contiguous tensor the matmuls read in place, its unused columns zero: `engine/hf_batch.SpareLayer.wide`) have
the columns past the mask masked out. Under autograd at a lower precision (bf16 autocast), the probabilities are
kept for the backward once, in that precision (`_LowPrecisionSoftmax`): transformers' eager kernel keeps the float32
softmax and its bf16 cast, a float32 `[B, H, Q, L]` per layer. The forward is the same; the softmax's gradient
reads the bf16 probabilities the value matmul reads anyway, so it differs from eager's by their rounding.
`register_grouped_attention` makes the name known to transformers; it is idempotent and `load_pretrained` calls it
when asked for `grouped`.
`IMPLEMENTATIONS` lists what the engine's and the trainer's keys accept.

What it does not do: dropout (it is an inference and RL-training kernel; attention dropout must be 0),
attention weights output (returns None), sliding windows or sinks beyond what the mask encodes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

GROUPED = "grouped"
"""The `attn_implementation` name this module registers."""
IMPLEMENTATIONS = (None, "eager", "sdpa", GROUPED)
"""What `engine.attn_implementation` and `trainer.attn_implementation` take: transformers' default (None), a
kernel transformers names, or `grouped`."""


def check_implementation(key: str, value: str | None) -> None:
    """A clear error naming `key` when `value` is not one of `IMPLEMENTATIONS`."""
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"{key}={value!r}; use one of {IMPLEMENTATIONS[1:]} or null (transformers' default)")


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention output `[B, Q, H, D]` of `query` `[B, H, Q, D]` over `key`/`value` `[B, KVH, L, D]`."""
    if dropout and module.training:
        raise ValueError("attn_implementation=grouped has no attention dropout; set attention_dropout=0")
    batch, heads, length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, group * length, dim), key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        mask = attention_mask[:, :, None, :, :kv_length]
        if mask.shape[-1] < kv_length:  # keys wider than the mask: the columns past it are masked out
            mask = torch.nn.functional.pad(mask, (0, kv_length - mask.shape[-1]), value=torch.finfo(mask.dtype).min)
        scores = (scores.view(batch, kv_heads, group, length, kv_length) + mask).view(scores.shape)
    probs = softmax_probs(scores, _matmul_dtype(query))
    output = torch.matmul(probs, value).view(batch, heads, length, dim)
    return output.transpose(1, 2).contiguous(), None


def _matmul_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the value matmul reads: autocast's where it is on (rotary embeddings leave the query float32),
    else the query's."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def softmax_probs(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores) over the last axis in float32, cast to `dtype`; kept for the backward only in `dtype`."""
    if dtype != torch.float32 and torch.is_grad_enabled() and scores.requires_grad:
        return _LowPrecisionSoftmax.apply(scores, dtype)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


class _LowPrecisionSoftmax(torch.autograd.Function):
    """Float32 softmax cast to a lower precision, saving only the cast probabilities for the backward."""

    @staticmethod
    def forward(ctx: Any, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        ctx.save_for_backward(probs)
        ctx.scores_dtype = scores.dtype
        return probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs = ctx.saved_tensors[0].float()
        grad = grad.float()
        return (probs * (grad - (grad * probs).sum(-1, keepdim=True))).to(ctx.scores_dtype), None


def register_grouped_attention() -> None:
    """Make `attn_implementation="grouped"` known to transformers (the attention and eager's mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED, grouped_attention)
    AttentionMaskInterface.register(GROUPED, eager_mask)


def cache_argument(model: torch.nn.Module) -> str:
    """The forward argument of `model` (or of the model a DeepSpeed engine wraps) that takes a KV cache: `cache`
    in recent transformers, `past_key_values` before."""
    forward = getattr(model, "module", model).forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
