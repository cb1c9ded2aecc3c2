"""Per-request token sampling and stop-string detection for the embedded engine.

`sample_rows` turns one decode step's logits (one row per request) into a token and its logprob per
row. The logprob is log_softmax(logits / T) over the full vocabulary in float32, taken before top-k and
top-p truncation, exactly as the trainer recomputes it (T = 1 for greedy). Each request samples with its
own `torch.Generator`, so its draws do not depend on which other requests share the batch.

`StopStringMatcher` detokenizes a request's output incrementally (only the new tail is decoded each
step) and reports the first stop string that appears in the generated text.

This module does not batch, schedule or run the model; `hf.py` does. It does not trim text after a
stop string either: tokens are kept as generated and trimming is the caller's job.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    buffer when given (valid until its next use)."""
    space = space or Workspace()
    scaled = space.take("scaled", logits, torch.float32).copy_(logits)
    temps = [t if t > 0 else 1.0 for t in temperatures]
    if any(t != 1.0 for t in temps):  # x / 1 is x: all-T=1 steps skip the division
        scaled.div_(torch.tensor(temps, dtype=torch.float32, device=logits.device).unsqueeze(1))
    return torch.log_softmax(scaled, dim=-1, out=space.take("logprobs", logits, torch.float32))


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


def draw_rows(probs: torch.Tensor, generators: Sequence[torch.Generator], space: Workspace | None = None
              ) -> torch.Tensor:
    """One index per row of `probs` [rows, vocab], drawn with probability proportional to the row, by inverse CDF:
    one uniform number from the row's own generator located in the row's float64 running sum, all rows in one
    cumsum and one search. Never an index of probability 0. (`torch.multinomial` does the same draw at 5-25 ms
    per 49k-token row on a CPU, as long as a decode step of a 135M model; row by row this took about 0.15 ms a
    row, batched about a third of that.) The running sum goes into `space`'s buffer when given."""
    cdf = (space or Workspace()).take("cdf", probs, torch.float64).copy_(probs).cumsum_(1)
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    for row in torch.nonzero(index >= probs.shape[1]).flatten().tolist():
        index[row] = torch.nonzero(probs[row])[-1, 0]  # the point rounded up to the total: the last drawable token
    return index


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                space: Workspace | None = None) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [rows, vocab]; returns token ids and their full logprobs. Rows that
    sample the whole vocabulary (no top-k, no top-p) draw together (`draw_rows`), greedy rows take their argmax
    together, the others sample one by one; each row's token depends only on its logits and its own generator
    either way. `space` (one per calling thread) keeps the step's large buffers from step to step."""
    space = space or Workspace()
    logprobs = full_logprobs(logits, [p.temperature for p in params], space)
    picked = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    whole = [i for i, p in enumerate(params) if p.temperature > 0 and p.top_k < 1 and p.top_p >= 1.0]
    if whole:
        rows = logprobs if len(whole) == len(params) else logprobs[whole]
        probs = torch.exp(rows, out=space.take("probs", rows, torch.float32))
        picked[whole] = draw_rows(probs, [generators[i] for i in whole], space)
    if greedy := [i for i, p in enumerate(params) if p.temperature <= 0]:
        picked[greedy] = torch.argmax(logprobs if len(greedy) == len(params) else logprobs[greedy], dim=1)
    for i in sorted(set(range(len(params))) - set(whole) - set(greedy)):
        picked[i] = sample_row(logprobs[i], params[i], generators[i])
    chosen = logprobs.gather(1, picked.view(-1, 1)).squeeze(1)
    return picked.tolist(), chosen.tolist()


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
