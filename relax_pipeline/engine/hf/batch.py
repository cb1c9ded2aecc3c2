"""The embedded engine's per-request record, its padded shared KV-cache batch, its forward calls and prefill.

`Request` is one generation from submission to result (owned by the worker thread); `Batch` holds the active
requests' shared cache, padded so every row ends at the same column (a row's tokens are the columns its attention
mask marks: a prefill from a cached prefix may leave a masked hole between prefix and suffix); its layers are
`SpareLayer`s, which append a decode step's column into spare room instead of copying the whole cache, and rows
leave (their places taken by rows from the end) and join (into the rows that left) without copying it either;
under `grouped` attention a decode step reads them at the buffer's full width (`SpareLayer.wide`), which a batched
matmul takes in place. `ModelCall` runs the batched prefill of `Chunk`s (each a cached prefix from
`prefix_cache.py` plus the tokens still to compute, left-padded into one forward with per-row positions), the
prefill of one prompt with images (pixels and mrope positions), and one decode step for the whole batch.
Every forward names its rows' LoRA adapters (`adapters.py`; a `Request`'s `adapter`), so one decode batch mixes
adapters; a `Prefiller` serves one adapter, its prefix cache holding that adapter's KV only.
`Prefiller` decides what each admission round prefills and what goes into the prefix cache; `row_kv` reads a row's
KV back out in the cache's layout. Split from `engine.py`, which owns scheduling, threads and the async API; this
module starts no thread and touches no event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from relax_pipeline.engine.base import (
    AdapterWeights,
    FinishReason,
    GenerateResult,
    ImageFeatures,
    SamplingParams,
    varying,
)
from relax_pipeline.engine.hf.adapters import BASE, Adapters
from relax_pipeline.engine.hf.decode_step import decode_step
from relax_pipeline.engine.hf.prefix_cache import Hit, PrefixCache, Tokens, buckets, shared_prefixes
from relax_pipeline.engine.sampling import StopStringMatcher
from relax_pipeline.models.attention import GROUPED, cache_argument

MIN_SAVED_TOKENS = 32
"""A prefix shared by several prompts of one admission round gets its own prefill pass when that saves at
least this many token computations ((sharers - 1) x its uncached tokens): a pass has a fixed cost."""

TRIM_COLUMNS = 16
"""`Batch.keep` copies the cache to drop leading columns once every kept row pads at least this many (a decode
step over 96 rows of SmolLM2 costs about 10% more at 92 columns than at 60)."""

_log = logging.getLogger(__name__)


def memory_short(error: BaseException) -> bool:
    """Whether `error` says an allocation failed (CPU or accelerator)."""
    oom = getattr(torch, "OutOfMemoryError", MemoryError)
    return isinstance(error, MemoryError | oom) or "can't allocate memory" in str(error)


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
    adapter: str | None = None
    """The LoRA adapter that serves this request (engine/hf/adapters.py), `BASE` for the base weights alone; None
    until submitted (then the engine's default)."""
    rope_delta: int = 0
    """Position of the next token minus its cache index (nonzero only after images)."""
    queued_at: int = 0
    """The engine's decode step count when the request was queued (how long it has waited for admission)."""
    epoch: int = -1
    """The prefix cache's epoch when this request was prefilled; its KV is cached only within that epoch."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    matched: str | int | None = None
    submitted: float = field(default_factory=time.perf_counter)
    """When the request was made (perf_counter seconds)."""
    first_token_s: float | None = None
    """Seconds from `submitted` to the first sampled token (`GenerateResult.first_token_s`)."""

    @property
    def cached_len(self) -> int:
        """Tokens of this request in the KV cache: the last sampled token is not fed yet."""
        return len(self.prompt) + len(self.output_ids) - 1

    def push(self, token: int, logprob: float, version: int) -> FinishReason | None:
        """Record one sampled token; return the finish reason it causes, if any."""
        if not self.output_ids:
            self.first_token_s = time.perf_counter() - self.submitted
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
            first_token_s=self.first_token_s,
        )


class SpareLayer(DynamicLayer):
    """A cache layer that writes new columns into spare room instead of concatenating the whole cache.

    `keys`/`values` are views of the first rows and columns of a larger buffer; a decode step copies one column
    where `DynamicLayer` copies the whole cache, and rows leaving the batch (`Batch.keep`) only shorten the view.
    Whoever replaces `keys`/`values` with another tensor (the batch merging rows) simply causes one reallocation
    at the next update.
    """

    spare = 16
    """Columns of room added at each reallocation, plus one per 16 in use: a wide decode step computes attention
    over the spare columns too, and each reallocation copies the cache once (at batch 64 on a CPU the two balance
    near 1.5 x sqrt(columns) spare)."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.wide = wide
        """A decode step (one new column) returns keys/values at the buffer's full width, unused columns zero: a
        contiguous tensor that a batched matmul reads in place where the narrower view would be copied first
        (about half a decode step at batch 64). Only for attention that masks the columns past its mask
        (`attention.grouped_attention`)."""
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        rows, used, new = self.keys.shape[0], self.keys.shape[2], key_states.shape[2]
        if not self._fits(used + new):
            self._room = (self._grown(self.keys, used + new), self._grown(self.values, used + new))
        keys, values = self._room  # type: ignore[misc]
        keys[:rows, :, used : used + new] = key_states
        values[:rows, :, used : used + new] = value_states
        self.keys, self.values = keys[:rows, :, : used + new], values[:rows, :, : used + new]
        if self.wide and new == 1:
            return keys[:rows], values[:rows]
        return self.keys, self.values

    def _fits(self, length: int) -> bool:
        """Whether `keys`/`values` are still the head of the buffer and it has room for `length` columns."""
        if self._room is None:
            return False
        return all(mine.data_ptr() == room.data_ptr() and mine.shape[0] <= room.shape[0]
                   and mine.shape[1] == room.shape[1] and mine.stride() == room.stride() and length <= room.shape[2]
                   for mine, room in zip((self.keys, self.values), self._room, strict=True))

    def room_for(self, rows: int, columns: int) -> bool:
        """Whether `append_rows` can take `rows` more rows of at most `columns` columns (the columns in use)."""
        return (self._room is not None and self._fits(self.keys.shape[2]) and columns <= self.keys.shape[2]
                and self.keys.shape[0] + rows <= self._room[0].shape[0])

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows after the rows in use, right-aligned, their columns to the left zeroed (`room_for` first)."""
        assert self._room is not None
        start, used, (count, _, width, _) = self.keys.shape[0], self.keys.shape[2], keys.shape
        for room, new in zip(self._room, (keys, values), strict=True):
            room[start : start + count, :, : used - width].zero_()
            room[start : start + count, :, used - width : used] = new
        self.keys, self.values = (room[: start + count, :, :used] for room in self._room)

    def _grown(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        batch, heads, used, dim = tensor.shape
        room = tensor.new_zeros(batch, heads, length + self.spare + length // 16, dim)  # `wide` reads unused columns
        room[:, :, :used] = tensor
        return room


def new_cache(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), wide: bool = False) -> DynamicCache:
    """A cache of `SpareLayer`s (`wide` ones when asked), holding `pairs` (keys, values per layer) when given."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(SpareLayer, wide)
    for keys, values in pairs:
        layer = SpareLayer(wide)
        layer.update(keys, values)
        cache.layers.append(layer)
    return cache


def left_pad(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `tensor` on the left of `dim` up to `length`."""
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    return torch.nn.functional.pad(tensor, [0, 0] * (tensor.dim() - 1 - dim) + [missing, 0])


class Batch:
    """Active requests with one shared KV cache, padded so every row ends at the same column.

    `mask` [rows, columns] marks each row's own tokens; every other column of a row is padding that its
    attention never sees (zeros on the left, or a hole after a cached prefix).
    """

    def __init__(self) -> None:
        self.rows: list[Request] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    def add(self, rows: Sequence[Request], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled `rows` whose `cache` and `mask` [len(rows), columns] hold exactly their tokens: into
        the buffer's free rows (left by `keep`) when they are no longer than the batch, else by concatenation."""
        if self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = list(rows), cache, mask
            return
        length = max(self.mask.shape[1], mask.shape[1])
        pairs = list(zip(self.cache.layers, cache.layers, strict=True))
        if all(isinstance(big, SpareLayer) and big.room_for(len(rows), mask.shape[1]) for big, _ in pairs):
            for big, small in pairs:
                big.append_rows(small.keys, small.values)
        else:
            for big, small in pairs:
                big.keys = torch.cat([left_pad(big.keys, length, 2), left_pad(small.keys, length, 2)])
                big.values = torch.cat([left_pad(big.values, length, 2), left_pad(small.values, length, 2)])
        self.mask = torch.cat([left_pad(self.mask, length, 1), left_pad(mask, length, 1)])
        self.rows.extend(rows)

    def keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` (ascending): each leaving row's place is taken by a kept row from the end, so only
        those rows are copied and the cache stays a view of its buffer. Leading columns that every kept row pads
        are cut off once there are `TRIM_COLUMNS` of them (the next update then copies the cache once)."""
        if not keep or self.cache is None or self.mask is None:
            self.rows, self.cache, self.mask = [], None, None
            return
        if len(keep) == len(self.rows):
            return
        order = fill_from_end(keep)
        moved = [(dst, src) for dst, src in enumerate(order) if dst != src]
        if moved:
            dst, src = (torch.tensor(side, device=self.mask.device) for side in zip(*moved, strict=True))
            for layer in self.cache.layers:
                layer.keys[dst], layer.values[dst] = layer.keys[src], layer.values[src]
            self.mask[dst] = self.mask[src]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[: len(order)], layer.values[: len(order)]
        self.mask, self.rows = self.mask[: len(order)], [self.rows[i] for i in order]
        if (cut := leading_padding(self.mask)) >= TRIM_COLUMNS:
            for layer in self.cache.layers:  # views: the next update moves them into a buffer of their own
                layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
            self.mask = self.mask[:, cut:]


def fill_from_end(keep: list[int]) -> list[int]:
    """The order of kept rows after `Batch.keep`: rows of `keep` below len(keep) stay where they are, and each
    place a leaving row frees there is taken by the kept rows at or past len(keep), in order."""
    count, kept = len(keep), set(keep)
    tail = iter([i for i in keep if i >= count])
    return [i if i in kept else next(tail) for i in range(count)]


def leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns of `mask` [rows, columns] are padding in every row."""
    return int(torch.argmax(mask.any(0).to(torch.int8)))


def take(cache: DynamicCache, mask: torch.Tensor, keep: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """Rows `keep` of `cache` (changed in place) and `mask`, without the leading columns all of them pad."""
    index = torch.tensor(keep, device=mask.device)
    mask = mask[index]
    cut = leading_padding(mask)
    for layer in cache.layers:
        layer.keys = layer.keys[index, :, cut:]
        layer.values = layer.values[index, :, cut:]
    return cache, mask[:, cut:]


def row_kv(cache: DynamicCache, mask: torch.Tensor, row: int, start: int = 0) -> torch.Tensor:
    """KV of `row`'s tokens from its `start`-th on, `[layers, 2, heads, tokens, dim]` (the prefix cache's layout)."""
    columns = mask[row].nonzero().squeeze(1)[start:]
    return torch.stack([torch.stack([layer.keys[row, :, columns], layer.values[row, :, columns]])
                        for layer in cache.layers])


@dataclass(frozen=True)
class Chunk:
    """One row of a batched prefill: the KV of a cached prefix (pieces from the prefix cache) and the
    tokens to compute after it."""

    prefix: int
    """Tokens already cached; the new tokens take positions prefix, prefix + 1, ..."""
    pieces: tuple[torch.Tensor, ...]
    """The prefix's KV, `[layers, 2, heads, tokens, dim]` each, in order; their tokens add up to `prefix`."""
    tokens: tuple[int, ...]
    """Tokens to run (at least one)."""


@dataclass(frozen=True)
class Prefilled:
    """What a batched prefill returns: last-token logits [rows, vocab] and the rows' cache and mask."""

    logits: torch.Tensor
    cache: DynamicCache
    mask: torch.Tensor


class ModelCall:
    """Forward passes with our own cache, hiding kwarg names that differ across transformers versions."""

    def __init__(self, model: torch.nn.Module) -> None:
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.device = next(model.parameters()).device
        self._cache_key = cache_argument(model)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.wide = getattr(model.config, "_attn_implementation", None) == GROUPED
        """Whether the caches it makes are `SpareLayer.wide` (the model's attention masks the extra columns)."""
        self.step = decode_step(model)
        """The written-out decode step (`decode_step.py`) where it fits the model, else None (the model's forward)."""
        self.adapters = Adapters(model)
        """The model's LoRA adapters (engine/hf/adapters.py); each forward names its rows' adapters."""

    def load_adapter(self, adapter: AdapterWeights) -> None:
        """Load `adapter` into the model; the decode step is rebuilt when its layers are new."""
        if self.adapters.load(adapter):
            self.step = decode_step(self.model)

    def _names(self, names: Sequence[str]) -> list[str] | None:
        """PEFT's `adapter_names` for a forward over rows of these adapters (`Adapters.names`)."""
        return self.adapters.names(names)

    def prefill(self, chunks: Sequence[Chunk], adapter: str = BASE) -> Prefilled:
        """Run every chunk's tokens after its cached prefix in one forward pass, with LoRA `adapter`.

        Row i holds its prefix right-aligned in the first P columns and its tokens right-aligned in the last
        S columns (P, S: the largest prefix and token count); the columns in between are masked padding.
        """
        width = max(len(c.tokens) for c in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.long)
        positions = torch.zeros(len(chunks), width, dtype=torch.long)
        new_mask = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            size = len(chunk.tokens)
            ids[i, width - size :] = torch.tensor(chunk.tokens)
            positions[i, width - size :] = torch.arange(chunk.prefix, chunk.prefix + size)
            new_mask[i, width - size :] = 1
        cache, old_mask = self._prefix_cache(chunks)
        mask = torch.cat([old_mask, new_mask.to(self.device)], dim=1)
        kwargs = {self._cache_key: cache, **self._last_only}
        with self.adapters.rows(self._names([adapter] * len(chunks))):
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask,
                             position_ids=positions.to(self.device), use_cache=True, **kwargs)
        return Prefilled(out.logits[:, -1], cache, mask)

    def _prefix_cache(self, chunks: Sequence[Chunk]) -> tuple[DynamicCache, torch.Tensor]:
        """A cache holding each chunk's prefix right-aligned in P columns, and its mask [rows, P]."""
        width = max(c.prefix for c in chunks)
        mask = torch.zeros(len(chunks), width, dtype=torch.long, device=self.device)
        if width == 0:
            return new_cache(wide=self.wide), mask
        sample = next(c.pieces[0] for c in chunks if c.pieces)
        layers, _, heads, _, dim = sample.shape
        kv = sample.new_zeros(layers, 2, len(chunks), heads, width, dim)
        for i, chunk in enumerate(chunks):
            column = width - chunk.prefix
            mask[i, column:] = 1
            for piece in chunk.pieces:
                kv[:, :, i, :, column : column + piece.shape[3]] = piece
                column += piece.shape[3]
        return new_cache([(kv[layer, 0], kv[layer, 1]) for layer in range(layers)], self.wide), mask

    def prefill_media(self, request: Request) -> Prefilled:
        """Run one prompt with images alone (pixels, mrope positions); sets the request's rope delta."""
        cache = new_cache(wide=self.wide)
        ids = torch.tensor([list(request.prompt)], dtype=torch.long, device=self.device)
        kwargs = {self._cache_key: cache, **self._last_only, **self._vision_inputs(ids, request)}
        with self.adapters.rows(self._names([request.adapter or BASE])):
            out = self.model(input_ids=ids, use_cache=True, **kwargs)
        return Prefilled(out.logits[:, -1], cache, torch.ones_like(ids))

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
        names = self._names([r.adapter or BASE for r in rows])
        if self.step is not None:
            return self.step(ids, positions, batch.mask, batch.cache, names)
        kwargs = {self._cache_key: batch.cache}
        with self.adapters.rows(names):
            out = self.model(input_ids=ids, attention_mask=batch.mask, position_ids=positions, use_cache=True,
                             **kwargs)
        return out.logits[:, -1]


class Prefiller:
    """Prefill through the prefix cache, and cache what was computed.

    `text` first computes, once each, the prefixes that several prompts of the round share beyond what is
    cached (parents before children, `MIN_SAVED_TOKENS`), then runs every prompt after its longest cached
    prefix (all but its last token may come from the cache), in left-padded passes of similar lengths
    (`buckets`); it yields each pass's rows with their result and caches their prompts' KV. `remember`
    caches a leaving batch row's prompt + generated tokens, unless the weights changed since its prefill
    (`Request.epoch`). With the cache off (budget 0) every prompt is prefilled whole, still batched.
    """

    def __init__(self, call: ModelCall, prefix: PrefixCache, stats: dict[str, int], adapter: str = BASE) -> None:
        self.call = call
        self.prefix = prefix
        self.stats = stats
        self.adapter = adapter
        """The LoRA adapter of every request this prefiller serves (its cache holds that adapter's KV only)."""

    def text(self, requests: Sequence[Request]) -> Iterator[tuple[list[Request], Prefilled]]:
        """Prefill text `requests`; yields (rows, result) per forward pass."""
        self._warm([r.prompt[:-1] for r in requests])
        chunks = [self._chunk(r.prompt, len(r.prompt) - 1) for r in requests]
        for part in buckets([len(c.tokens) for c in chunks]):
            rows, parts = [requests[i] for i in part], [chunks[i] for i in part]
            done = self._run(lambda parts=parts: self.call.prefill(parts, self.adapter))  # type: ignore[misc]
            self.stats["cached_tokens"] += sum(c.prefix for c in parts)
            for i, (request, chunk) in enumerate(zip(rows, parts, strict=True)):
                self._store(request.prompt, done, i, chunk.prefix)
            yield rows, done

    def media(self, request: Request) -> Prefilled:
        """Prefill a prompt with images alone; it neither reads nor feeds the cache (images are not keys)."""
        self.stats["prefill_tokens"] += len(request.prompt)
        return self._run(lambda: self.call.prefill_media(request))

    def remember(self, batch: Batch, rows: list[int]) -> None:
        """Cache the KV of `batch` rows about to leave (prompt + generated tokens) for later requests."""
        if not self.prefix.enabled or batch.cache is None or batch.mask is None:
            return
        for i in rows:
            request = batch.rows[i]
            if request.epoch != self.prefix.epoch or request.media:
                continue
            tokens = request.prompt + tuple(request.output_ids[:-1])
            start = self.prefix.match_len(tokens)
            if start < len(tokens):
                self.prefix.insert(tokens, row_kv(batch.cache, batch.mask, i, start), start)

    def _warm(self, keys: list[Tokens]) -> None:
        """Compute (and cache) the prefixes several `keys` share, once each, parents before children."""
        if not self.prefix.enabled:
            return
        pending = shared_prefixes(keys)
        while pending := [p for p in pending if self._saving(p, keys) >= MIN_SAVED_TOKENS]:
            level = [p for p in pending if not any(len(q) < len(p) and p[: len(q)] == q for q in pending)]
            chunks = [self._chunk(p, len(p)) for p in level]
            for part in buckets([len(c.tokens) for c in chunks]):
                parts = [chunks[i] for i in part]
                done = self._run(lambda parts=parts: self.call.prefill(parts, self.adapter))  # type: ignore[misc]
                for i, index in enumerate(part):
                    self._store(level[index], done, i, chunks[index].prefix)
            finished = set(level)
            pending = [p for p in pending if p not in finished]

    def _saving(self, prefix: Tokens, keys: list[Tokens]) -> int:
        """Token computations saved by prefilling `prefix` once for every key that starts with it."""
        sharers = sum(1 for k in keys if k[: len(prefix)] == prefix)
        return (sharers - 1) * (len(prefix) - self.prefix.match_len(prefix))

    def _chunk(self, tokens: Tokens, limit: int) -> Chunk:
        """`tokens` split into its longest cached prefix (at most `limit` tokens) and the rest to compute."""
        hit = self.prefix.match(tokens, limit) if self.prefix.enabled else Hit(0)
        return Chunk(hit.length, hit.pieces, tokens[hit.length :])

    def _store(self, tokens: Tokens, done: Prefilled, row: int, start: int) -> None:
        """Cache the KV a prefill computed for `tokens[start:]` (row `row` of `done`)."""
        self.stats["prefill_tokens"] += len(tokens) - start
        if self.prefix.enabled:
            self.prefix.insert(tokens, row_kv(done.cache, done.mask, row, start), start)

    def _run(self, forward: Callable[[], Prefilled]) -> Prefilled:
        """Run a prefill pass; when memory runs short, release the prefix cache and try once more."""
        self.stats["prefill_passes"] += 1
        try:
            return forward()
        except Exception as error:
            if not memory_short(error) or self.prefix.nbytes == 0:
                raise
            _log.warning("hf engine: memory ran short (%s); released the prefix cache (%d MB)", error,
                         self.prefix.nbytes >> 20)
            self.prefix.clear()
            return forward()
