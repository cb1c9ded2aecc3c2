"""Logprobs of chosen tokens (and entropies) from a forward's logits, a few vocabulary rows at a time.

The trainer's logprob is the engine's: log_softmax(logits / temperature) over the full vocabulary in float32,
gathered at the next token. Written as whole-tensor torch ops, one micro-batch of a 49k vocabulary materialises
the float32 cast, the division, the log-softmax (kept for the backward), its exponential and the entropy's product,
each [rows, V] (about 200 MB apiece for 64 rows of 16 tokens), and the backward as many again. `token_logprobs`
computes the same values `CHUNK_ELEMENTS` at a time in a custom autograd function: the forward keeps only the
logits (which the model's output holds anyway) and writes [J] results; the backward recomputes each chunk's
log-softmax and writes the logits' gradient into one tensor of the logits' dtype. Per row, the forward is the
same sequence of torch ops on the same values (so the same numbers); the gradient is the one autograd computes
through those ops (grad - exp(logp) * sum(grad), divided by the temperature, plus the entropy's term), summed in
its own order where several (b, t) read one row.

Contract: `logits` [N, V] (any float dtype; under autocast, bf16), `rows` and `targets` [B, T] (which logits row
predicts token (b, t), and that token); returns chosen [B, T] float32 and, unless `entropy` is "none", the entropy
of each (b, t)'s row [B, T] float32, differentiable only under "train". Only the logits rows `rows` names are
computed.

What it does not do: run the model or the LM head (the logits arrive whole, in the forward's dtype), or pick the
rows (train/step.py and train/tree_batch.py do).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Entropy = Literal["none", "metric", "train"]
CHUNK_ELEMENTS = 1 << 22
"""Float32 elements of one chunk's [rows, V] working tensors (16 MiB each: 85 rows of a 49k vocabulary)."""


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float,
                   entropy: Entropy = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs of `targets` under the logits rows `rows` at `temperature` (0 reads as 1), and their
    entropies unless `entropy` is "none" ("metric": detached; "train": with gradient)."""
    scale = temperature if temperature > 0 else 1.0
    used, inverse = torch.unique(rows.reshape(-1), return_inverse=True)
    chosen, entropies = _ChosenLogprobs.apply(logits, used, inverse, targets.reshape(-1), scale, entropy != "none")
    chosen = chosen.view(rows.shape)
    if entropy == "none":
        return chosen, None
    entropies = entropies if entropy == "train" else entropies.detach()
    return chosen, entropies[inverse].view(rows.shape)


def chunk_rows(vocab: int) -> int:
    """Logits rows per chunk: `CHUNK_ELEMENTS` float32 elements, at least one row."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_logp(logits: torch.Tensor, used: torch.Tensor, start: int, end: int, scale: float) -> torch.Tensor:
    """log_softmax(logits[used[start:end]].float() / scale), the per-row ops of the whole-tensor form."""
    return torch.log_softmax(logits.index_select(0, used[start:end]).float() / scale, dim=-1)


def _pairs(inverse: torch.Tensor, count: int) -> tuple[torch.Tensor, list[int]]:
    """The (b, t) pairs ordered by the row they read, and where each chunk's run of them starts."""
    order = torch.argsort(inverse, stable=True)
    return order, torch.searchsorted(inverse[order], torch.arange(count + 1)).tolist()


class _ChosenLogprobs(torch.autograd.Function):
    """Chunked log-softmax, gather and entropy over the used logits rows; saves only its inputs."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, used: torch.Tensor, inverse: torch.Tensor, targets: torch.Tensor,
                scale: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = torch.empty(inverse.shape, dtype=torch.float32, device=logits.device)
        entropies = torch.zeros(len(used) if with_entropy else 0, dtype=torch.float32, device=logits.device)
        order, bounds = _pairs(inverse, len(used))
        step = chunk_rows(logits.shape[-1])
        for start in range(0, len(used), step):
            end = min(start + step, len(used))
            logp = _chunk_logp(logits, used, start, end, scale)
            pairs = order[bounds[start] : bounds[end]]
            chosen[pairs] = logp[inverse[pairs] - start, targets[pairs]]
            if with_entropy:
                entropies[start:end] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, used, inverse, targets)
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        return chosen, entropies

    @staticmethod
    def backward(ctx: Any, grad_chosen: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        logits, used, inverse, targets = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        order, bounds = _pairs(inverse, len(used))
        step = chunk_rows(logits.shape[-1])
        for start in range(0, len(used), step):
            end = min(start + step, len(used))
            logp = _chunk_logp(logits, used, start, end, ctx.scale)
            pairs = order[bounds[start] : bounds[end]]
            grad_logp = torch.zeros_like(logp)
            if grad_chosen is not None:
                grad_logp.index_put_((inverse[pairs] - start, targets[pairs]), grad_chosen[pairs], accumulate=True)
            probs = logp.exp()
            if grad_entropy is not None and grad_entropy.numel():
                grad_logp -= grad_entropy[start:end, None] * (probs * logp + probs)
            grad_logits = (grad_logp - probs * grad_logp.sum(-1, keepdim=True)) / ctx.scale
            grad.index_copy_(0, used[start:end], grad_logits.to(grad.dtype))
        return grad, None, None, None, None, None
