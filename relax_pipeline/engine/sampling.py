"""Per-request token sampling and stop-string detection for the embedded engine.

`sample_rows` turns one decode step's logits (one row per request) into a token and its logprob per
row. The logprob is log_softmax(logits / T) over the full vocabulary in float32 (`full_logprobs`), taken
before top-k and top-p truncation, as the trainer recomputes it (T = 1 for greedy). Each request samples
with its own `torch.Generator`, so its draws do not depend on which other requests share the batch. The
common case (whole-vocabulary sampling) costs one softmax and one read of the probabilities a step: the
draw searches block sums first (`draw_rows`), and no float32 logprob row is materialised.

`StopStringMatcher` detokenizes a request's output incrementally (only the new tail is decoded each
step) and reports the first stop string that appears in the generated text.

This module does not batch, schedule or run the model; `hf/engine.py` does. It does not trim text after a
stop string either: tokens are kept as generated and trimming is the caller's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from relax_pipeline.engine.base import SamplingParams

_MAX_PENDING_IDS = 16
"""Give up waiting for a multi-token character after this many ids and accept replacement chars."""


def check_sampling(sampling: SamplingParams) -> None:
    """Raise ValueError naming the field when sampling settings are out of range."""
    if sampling.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {sampling.max_new_tokens}")
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k == 0 or sampling.top_k < -1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {sampling.top_k}")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`; one per request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Workspace:
    """Buffers that sampling reuses from one decode step to the next.

    A fresh `[rows, vocab]` tensor is fresh memory from the system, paid for by one page fault per 4 KiB: at 64
    rows of a 49k vocabulary the faults of the five such tensors a step makes cost several times the arithmetic.
    `take` hands out the first `rows` rows of a buffer kept per name (regrown when a step has more rows or another
    vocabulary), so each step writes into the memory the previous one used. One workspace per thread."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A `like`-shaped `[rows, vocab]` tensor of `dtype` on `like`'s device (its contents are garbage)."""
        rows, vocab = like.shape
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != vocab or buffer.dtype != dtype \
                or buffer.device != like.device:
            buffer = self._buffers[name] = torch.empty(rows, vocab, dtype=dtype, device=like.device)
        return buffer[:rows]


def full_logprobs(logits: torch.Tensor, temperatures: Sequence[float], space: Workspace | None = None
                  ) -> torch.Tensor:
    """log_softmax(logits / T) per row in float32, T = 1 where the request is greedy (T = 0); into `space`'s
    buffer when given (valid until its next use). The definition `sample_rows`' logprobs follow."""
    space = space or Workspace()
    scaled = scaled_logits(logits, temperatures, space)
    return torch.log_softmax(scaled, dim=-1, out=space.take("logprobs", logits, torch.float32))


def scaled_logits(logits: torch.Tensor, temperatures: Sequence[float], space: Workspace) -> torch.Tensor:
    """logits / T per row in float32 (T = 1 where greedy), into `space`'s "scaled" buffer (a copy and an
    in-place division: `torch.div(..., out=)` from bfloat16 costs more than the two)."""
    scaled = space.take("scaled", logits, torch.float32)
    temps = [t if t > 0 else 1.0 for t in temperatures]
    if all(t == 1.0 for t in temps):  # x / 1 is x: all-T=1 steps skip the division
        return scaled.copy_(logits)
    return scaled.copy_(logits).div_(torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(1))


def truncate(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logprobs outside the top-k / top-p nucleus to -inf; always keeps the most likely token."""
    if 0 < top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, top_k).values[-1]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, descending=True)
        probs = sorted_lp.exp()
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop[0] = False
        logprobs = logprobs.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logprobs


def sample_row(logprobs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Pick one token id (0-d tensor) from a row of full-vocabulary logprobs."""
    if sampling.temperature <= 0:
        return torch.argmax(logprobs)
    kept = truncate(logprobs, sampling.top_k, sampling.top_p)
    return draw(kept.exp(), generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index (0-d tensor) drawn with probability proportional to `probs`; see `draw_rows`."""
    return draw_rows(probs.unsqueeze(0), [generator])[0]


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One index per row of `probs` [rows, vocab] (weights >= 0), drawn with probability proportional to the row,
    by inverse CDF: one float64 uniform number from the row's own generator, scaled to the row's total, is
    located first among the running sums of `BLOCK`-wide blocks, then, mapped proportionally into its block,
    among the float64 running sums of that block's weights. A block is chosen with probability its sum / the
    total and a token with its weight / its block's sum, so each token's probability is its weight / the total
    up to the float32 rounding of the block sums (about 1e-7 relative, the rounding the weights carry anyway).
    Never an index of weight 0. Where one running sum over the whole row (a float64 copy and cumsum) took most of
    sampling, this reads the row once; `torch.multinomial` does the same draw more slowly on a CPU
    (docs/benchmarks.md, "Engine")."""
    sums = block_sums(probs)
    cdf = sums.cumsum(1)
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    target = uniform * cdf[:, -1]
    block = last_nonzero_past(sums, torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1))
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    columns = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=probs.device)
    weights = probs.gather(1, columns.clamp(max=probs.shape[1] - 1)).double() * (columns < probs.shape[1])
    inner = weights.cumsum(1)
    local = (target - before) / sums.gather(1, block.unsqueeze(1)).squeeze(1) * inner[:, -1]
    index = last_nonzero_past(weights, torch.searchsorted(inner, local.unsqueeze(1), right=True).squeeze(1))
    return block * BLOCK + index


BLOCK = 256
"""Tokens per block of `draw_rows`' first search (a 49k vocabulary: 192 blocks)."""


def block_sums(probs: torch.Tensor) -> torch.Tensor:
    """Sums of the `BLOCK`-wide column blocks of `probs` [rows, vocab], float32 accumulated, as float64."""
    return by_block(probs, torch.sum).double()


def by_block(values: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """`reduce(block, dim, keepdim)` of each `BLOCK`-wide column block of `values` [rows, vocab] (the last block
    may be narrower): [rows, blocks]."""
    rows, vocab = values.shape
    full = vocab // BLOCK * BLOCK
    parts = [reduce(values[:, :full].view(rows, -1, BLOCK), 2, False)] if full else []
    if full < vocab:
        parts.append(reduce(values[:, full:], 1, True))
    return torch.cat(parts, 1)


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(1)` (the first of equal maxima included) through the block maxima: on a CPU amax is fast and
    argmax's own reduction is not, so the block maxima first are faster (docs/benchmarks.md, "Engine")."""
    block = by_block(values, torch.amax).argmax(1)
    columns = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=values.device)
    inside = values.gather(1, columns.clamp(max=values.shape[1] - 1)).masked_fill(columns >= values.shape[1],
                                                                                 float("-inf"))
    return columns.gather(1, inside.argmax(1, keepdim=True)).squeeze(1)


def last_nonzero_past(weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`index` per row, except where it ran past the row (a point rounded up to the total): the row's last
    column of nonzero weight there."""
    for row in torch.nonzero(index >= weights.shape[1]).flatten().tolist():
        index[row] = torch.nonzero(weights[row])[-1, 0]
    return index


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                space: Workspace | None = None) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [rows, vocab]; returns token ids and their full logprobs
    (`full_logprobs`' values, to about 1e-7). One softmax over all rows gives the probabilities: rows that
    sample the whole vocabulary (no top-k, no top-p) draw from them together (`draw_rows`), greedy rows take
    their argmax, rows with top-k / top-p take their log_softmax and sample one by one. A token's logprob is
    scaled[token] - logsumexp(scaled), the logsumexp read off the argmax (scaled[a] - log p[a], p[a] >= 1/vocab,
    so exact to float32 rounding and never -inf). Each row's token depends only on its logits and its own
    generator. `space` (one per calling thread) keeps the step's large buffers from step to step."""
    space = space or Workspace()
    scaled = scaled_logits(logits, [p.temperature for p in params], space)
    probs = torch.ops.aten._softmax.out(scaled, 1, False, out=space.take("probs", logits, torch.float32))
    best = row_argmax(scaled)
    picked = best.clone()
    whole = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k < 1 and p.top_p >= 1.0]
    if whole:
        rows = probs if len(whole) == len(params) else probs[whole]
        picked[whole] = draw_rows(rows, [generators[i] for i in whole])
    for i in sorted(set(range(len(params))) - set(whole)):
        if params[i].temperature > 0:
            picked[i] = sample_row(torch.log_softmax(scaled[i], -1), params[i], generators[i])
    pair = scaled.gather(1, torch.stack([picked, best], 1)).double()
    top = probs.gather(1, best.unsqueeze(1)).squeeze(1).double().log()
    return picked.tolist(), (pair[:, 0] - pair[:, 1] + top).tolist()


class StopStringMatcher:
    """Finds stop strings in a request's generated text, decoding only the tail each step.

    Uses the prefix/read offsets of incremental detokenization: the text of the ids since the last
    completed character boundary is decoded and compared to the text already seen, so multi-byte
    characters split across tokens are only reported once complete. Decoding keeps special tokens
    (the model's literal output) and does not clean up spaces.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(s for s in stops if s)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._tail = ""

    def prime(self, token_ids: Sequence[int]) -> None:
        """Take ids generated before this request (a resumed generation's earlier output) as seen text, so a
        stop string that starts in them and ends in a new id is found; a stop inside them alone is not reported."""
        for token_id in token_ids:
            self.push(token_id)

    def push(self, token_id: int) -> str | None:
        """Add one generated id; return the stop string now contained in the text, if any."""
        self._ids.append(token_id)
        new_text = self._new_text()
        if not new_text:
            return None
        window = self._tail + new_text
        hit = next((s for s in self._stops if s in window), None)
        self._tail = window[len(window) - self._keep :] if self._keep else ""
        return hit

    def _new_text(self) -> str:
        """Text completed by the ids since the read offset; empty while a character is still partial."""
        seen = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if len(full) <= len(seen) or (full.endswith("\ufffd") and pending < _MAX_PENDING_IDS):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
