"""The embedded engine's per-request record, its left-padded shared KV-cache batch and its forward calls.

`Request` is one generation from submission to result (owned by the worker thread); `Batch` holds the
active requests' shared cache, left-padded so every row ends at the same column; `ModelCall` runs prefill
(one prompt alone, with pixels and mrope positions when it has images) and one decode step for the whole
batch with per-row positions. Split from `hf.py`, which owns scheduling, threads and the async API.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from relax_pipeline.engine.base import FinishReason, GenerateResult, ImageFeatures, SamplingParams, varying
from relax_pipeline.engine.sampling import StopStringMatcher


@dataclass(eq=False)
class Request:
    """One generation from submission to result; touched only by the worker thread once submitted."""

    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    limit: int
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateResult]
    matcher: StopStringMatcher | None = None
    media: tuple[ImageFeatures, ...] = ()
    """Images of the (already expanded) prompt, in order."""
    rope_delta: int = 0
    """Position of the next token minus its cache index (nonzero only after images)."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    matched: str | int | None = None

    @property
    def cached_len(self) -> int:
        """Tokens of this request in the KV cache: the last sampled token is not fed yet."""
        return len(self.prompt) + len(self.output_ids) - 1

    def push(self, token: int, logprob: float, version: int) -> FinishReason | None:
        """Record one sampled token; return the finish reason it causes, if any."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_ids:
            self.matched = token
            return "stop"
        if self.matcher is not None and (hit := self.matcher.push(token)) is not None:
            self.matched = hit
            return "stop"
        return "length" if len(self.output_ids) >= self.limit else None

    def result(self, reason: FinishReason, version: int) -> GenerateResult:
        """The frozen result; per-token versions only when they differ."""
        versions = tuple(self.versions)
        return GenerateResult(
            output_ids=tuple(self.output_ids),
            logprobs=tuple(self.logprobs),
            finish_reason=reason,
            weight_version=versions[-1] if versions else version,
            matched_stop=self.matched if reason == "stop" else None,
            weight_versions=varying(versions),
        )


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `tensor` on the left of `dim` up to `length`."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    return torch.nn.functional.pad(tensor, [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0])


class Batch:
    """Active requests with one shared KV cache, left-padded so every row ends at the same column."""

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def add(self, request: Request, cache: DynamicCache) -> None:
        """Append a prefilled request whose single-row `cache` holds exactly its prompt."""
        ones = torch.ones(1, len(request.prompt), dtype=torch.long, device=cache.layers[0].keys.device)
        if self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = [request], cache, ones
            return
        length = max(self.mask.shape[1], ones.shape[1])
        for big, small in zip(self.cache.layers, cache.layers, strict=True):
            big.keys = torch.cat([left_pad(big.keys, length, 2), left_pad(small.keys, length, 2)])
            big.values = torch.cat([left_pad(big.values, length, 2), left_pad(small.values, length, 2)])
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(ones, length, 1)])
        self.rows.append(request)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` and trim leading columns that are padding in every kept row."""
        if not keep or self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = [], None, None
            return
        cut = self.mask.shape[1] - max(self.rows[i].cached_len for i in keep)
        if len(keep) == len(self.rows) and cut == 0:
            return
        index = torch.tensor(keep, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, cut:]
            layer.values = layer.values[index, :, cut:]
        self.mask = self.mask[index, cut:]
        self.rows = [self.rows[i] for i in keep]


class ModelCall:
    """Forward passes with our own cache, hiding kwarg names that differ across transformers versions."""

    def __init__(self, model: torch.nn.Module) -> None:
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.device = next(model.parameters()).device
        self._cache_key = "cache" if "cache" in params else "past_key_values"
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def prefill(self, request: Request) -> tuple[torch.Tensor, DynamicCache]:
        """Run one prompt alone; return its last-position logits [1, vocab] and its cache."""
        cache = DynamicCache()
        ids = torch.tensor([list(request.prompt)], dtype=torch.long, device=self.device)
        kwargs = {self._cache_key: cache, **self._last_only}
        if request.media:
            kwargs.update(self._vision_inputs(ids, request))
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        return out.logits[:, -1], cache

    def _vision_inputs(self, ids: torch.Tensor, request: Request) -> dict[str, torch.Tensor]:
        """Pixels, grids and explicit mrope positions of a prompt with images; sets the request's delta."""
        grid = torch.tensor([list(m.grid_thw) for m in request.media], dtype=torch.long, device=self.device)
        token_types = (ids == self.model.config.image_token_id).int()
        positions, delta = self.model.model.get_rope_index(ids, mm_token_type_ids=token_types, image_grid_thw=grid)
        request.rope_delta = int(delta.reshape(-1)[0])
        pixels = torch.cat([m.pixel_values for m in request.media]).to(self.device)
        return {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": token_types,
                "position_ids": positions}

    def decode(self, batch: Batch) -> torch.Tensor:
        """One decode step for every row of `batch`; returns logits [rows, vocab] and grows the cache."""
        assert batch.mask is not None
        rows = batch.rows
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[r.cached_len + r.rope_delta] for r in rows], dtype=torch.long, device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(rows), 1)], dim=1)
        kwargs = {self._cache_key: batch.cache}
        out = self.model(
            input_ids=ids, attention_mask=batch.mask, position_ids=positions, use_cache=True, **kwargs
        )
        return out.logits[:, -1]
