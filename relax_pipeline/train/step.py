"""One optimizer step on one global batch, shared by the torch and DeepSpeed backends.

`optimizer_step` runs the whole GRPO-family step: pack micro-batches, recompute old logprobs (when
the rollout's are not used) and reference logprobs (when a reference exists) without gradient, expand
the base advantages over tokens (reinforce++ KL shaping with the old policy's k1 to the reference),
optionally whiten them over the global batch, then forward, `policy_loss` and backward per micro-batch,
and one optimizer step. The backend only supplies `backward(loss, last)` and `step() -> grad norm`.

Logprobs are computed exactly the way the engine computes them: log_softmax(logits / temperature) over
the full vocabulary in float32, gathered at the next token, with temperature 0 (greedy) read as 1; a chunk of
logits rows at a time (`token_logprobs`), so no [rows, V] float32 tensor is held for the backward.
With `StepSettings.autocast` (`trainer.autocast=bfloat16`) the model's forward and backward run under
`torch.autocast` in that dtype (weights, gradients and optimizer state stay float32; the softmax is float32):
on a CPU with bf16 dot-product instructions or any recent GPU the matmuls are faster, at the price of logprobs
that differ from a float32 engine's by bf16 rounding (the PPO ratio absorbs it; docs/benchmarks.md, "Training
step").
Batches are right-padded [B, L] with an attention mask (positions 0..len-1 per row, as in the engine's
unpadded prefill); the model is asked only for the logits from the earliest response position on
(`logits_to_keep`), so prompt positions never reach the LM head or the softmax. Rows of a text micro-batch
that start with the same tokens run those tokens once (`Collated.shared`): the samples of one GRPO group share
their whole prompt, and all samples share the chat template's preamble. Each distinct prefix runs once, as one
row of a prefix batch, and its keys and values are copied (or, for one prefix, expanded) to the rows that
start with it for the forward of the rest: the same logprobs (float tolerance) and the same gradient, since
autograd sums the rows' gradients back through the copy. So a micro-batch may hold several whole groups and
still compute each prompt once. With `trainer.batching.tree` (`collate(..., tree="auto")`) the rows may instead be
packed as prefix trees (train/tree_batch.py), the generalisation of the shared prompt to forks at any depth (a
forked session's leaves): every tree token runs once, and the forward gathers the same [B, T] logprobs the rows
give, so everything after it is unchanged; `collate` packs trees of at most `prefix_tree.TREE_ROW_NODES` nodes
a row (attention memory grows with a tree row's length squared), only where `prefix_tree.cost` says they cost
less than the padded rows (through their shared prefix), and the model's attention kernel must take a 4-D mask
(`tree_batch.supports_trees`; otherwise the rows run). A micro-batch whose
samples carry `multimodal_train_inputs` also feeds their `pixel_values` and `image_grid_thw` (concatenated
in row order) and the image-token mask, so a vision-language model computes the same mrope positions and
image embeddings as the engine did.

With several data-parallel ranks each rank runs `share_step` on its `RankShare` (train/data_parallel.py:
the split rule, the global normalizers, cross-rank whitening and metric sums); `optimizer_step` is the
one-rank case (one share holding the whole batch, packed by `batching.micro_batches`).

What this module does not do: build models or optimizers, checkpoint, decide the split or move samples
between ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from relax_pipeline.credit.settings import AdvantageSettings
from relax_pipeline.forest.sample import Sample
from relax_pipeline.models.attention import cache_argument
from relax_pipeline.train.advantages import token_advantages, whiten
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.data_parallel import AllSum, RankShare, shard, sum_metrics, whiten_across
from relax_pipeline.train.losses import LossBatch, LossSettings, policy_loss
from relax_pipeline.train.prefix_tree import TREE_ROW_NODES, cost, tree_groups
from relax_pipeline.train.provenance import MicroBatchTime, lag_kl_metrics, lag_kl_sums
from relax_pipeline.train.token_logprobs import Entropy, token_logprobs
from relax_pipeline.train.tree_batch import TreeBatch, pack_trees, supports_trees, tree_logits

Model = Callable[..., object]
"""A Hugging Face causal LM, or a DeepSpeed engine wrapping one (same call signature)."""


class Backend(Protocol):
    """What differs between backends: how a micro-batch loss is backpropagated and how the step is taken."""

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate the gradient of `loss`; `last` marks the optimizer step's final micro-batch."""

    def step(self) -> float:
        """Clip, step the optimizer, zero the gradients; return the global grad norm before clipping."""


@dataclass(frozen=True)
class StepSettings:
    """Everything one optimizer step needs besides the model; connects a trainer backend to `optimizer_step`."""

    loss: LossSettings
    batching: BatchSettings
    advantages: AdvantageSettings
    temperature: float = 1.0
    """The rollout's sampling temperature: logprobs are computed as the engine computed them."""
    autocast: str | None = None
    """`trainer.autocast`: the forward's mixed-precision dtype (`bfloat16`, `float16`), or None: float32."""

    def __post_init__(self) -> None:
        autocast_dtype(self.autocast)


AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype `trainer.autocast` names (None stays None); a clear error for anything else."""
    if name is None:
        return None
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"trainer.autocast={name!r}; choose {' or '.join(AUTOCAST_DTYPES)}, or null for float32")
    return AUTOCAST_DTYPES[name]


@dataclass(frozen=True)
class Collated:
    """One micro-batch as tensors: right-padded input [B, L] and response-aligned [B, T] views."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: int
    """Logits kept from the end (`logits_to_keep`): positions L - keep .. L - 1."""
    index: torch.Tensor
    """[B, T] position, within the kept logits, of the logits that predict response token j."""
    targets: torch.Tensor
    """[B, T] response token ids (0 on padding)."""
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    base: torch.Tensor
    """[B] base advantages."""
    multimodal: dict[str, torch.Tensor] | None = None
    """`pixel_values` and `image_grid_thw` of every row's images, in row order; None without images."""
    shared: int = 0
    """Leading columns computed once per distinct prefix (0: no prefix forward; every row runs whole)."""
    prefix_rows: tuple[int, ...] = (0,)
    """One row per distinct prefix: its first `shared` tokens run in the prefix forward."""
    prefix_of: tuple[int, ...] = ()
    """Per row, which of `prefix_rows` it starts with (empty: every row starts with the one prefix)."""
    tree: TreeBatch | None = None
    """The rows packed as prefix trees (train/tree_batch.py), run instead of the padded rows; None: per row."""


MIN_SHARED_PREFIX = 8
"""A common prefix shorter than this runs in every row: a separate forward pass has a fixed cost."""


TREE_MODES = ("off", "auto", "always")
"""`collate`'s tree packing: never, when `prefix_tree.cost` says it is cheaper than the rows, or always (tests)."""


def collate(samples: Sequence[Sample], pad_id: int, device: torch.device | str, tree: str = "off") -> Collated:
    """Right-pad `samples` into tensors on `device`; T is the longest response (at least 1). With `tree`
    ("auto": when cheaper, "always"), text rows are also packed as prefix trees, which the forward then runs."""
    length = max(len(s.tokens) for s in samples)
    width = max(1, max(s.response_length for s in samples))
    start = min(s.prompt_length for s in samples) - 1
    rows = [_row(s, length, width, start, pad_id) for s in samples]
    columns = [torch.tensor(list(c)) for c in zip(*rows, strict=True)]
    ids, attention, index, targets, mask, rollout = (c.to(device) for c in columns)
    base = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device)
    multimodal = _multimodal(samples, device)
    prefixes = shared_prefixes(samples, start) if multimodal is None else Prefixes()
    trees = _trees(samples, prefixes, tree, width, pad_id, device) if multimodal is None else None
    return Collated(ids, attention, length - start, index, targets, mask.float(), rollout.float(), base,
                    multimodal, prefixes.length, prefixes.rows, prefixes.of, trees)


def _trees(samples: Sequence[Sample], prefixes: Prefixes, mode: str, width: int, pad_id: int,
           device: torch.device | str) -> TreeBatch | None:
    """The packed trees of `samples` when `mode` asks for them and (under "auto") they cost less than the rows."""
    if mode not in TREE_MODES:
        raise ValueError(f"collate(tree={mode!r}); choose one of {TREE_MODES}")
    if mode == "off" or (mode == "auto" and len(samples) < 2) or not any(s.response_length for s in samples):
        return None
    groups = tree_groups([s.tokens for s in samples], TREE_ROW_NODES)
    longest = max(g.tree.size for g in groups)
    if mode == "auto" and len(groups) * cost(longest, longest) >= _rows_cost(samples, prefixes):
        return None
    return pack_trees(samples, groups, width, pad_id, device)


def _rows_cost(samples: Sequence[Sample], prefixes: Prefixes) -> float:
    """`prefix_tree.cost` of the padded rows, through the shared prefix when there is one."""
    length, shared = max(len(s.tokens) for s in samples), prefixes.length
    return len(prefixes.rows) * cost(shared, shared) * (shared > 0) + len(samples) * cost(length - shared, length)


@dataclass(frozen=True)
class Prefixes:
    """How the rows of one micro-batch share leading tokens; connects `shared_prefixes` to `Collated`."""

    length: int = 0
    """Leading tokens computed once per distinct prefix (0: none)."""
    rows: tuple[int, ...] = (0,)
    """The first row of each distinct prefix."""
    of: tuple[int, ...] = ()
    """Per row, the index in `rows` of its prefix (empty when there is one prefix)."""

    def saved(self, count: int) -> int:
        """Prefix tokens not computed, out of `count` rows."""
        return (count - len(self.rows)) * self.length


def shared_prefixes(samples: Sequence[Sample], limit: int) -> Prefixes:
    """The cheaper of two ways to share leading tokens (at most `limit`, the first position whose logits are
    kept): the prefix every row starts with, or the distinct first `limit` tokens (one per GRPO group). No
    sharing (`Prefixes()`) when neither saves a forward of at least `MIN_SHARED_PREFIX` tokens a row."""
    if len(samples) < 2 or limit < MIN_SHARED_PREFIX:
        return Prefixes()
    best = max((_common_prefix(samples, limit), _distinct_prefixes(samples, limit)),
               key=lambda p: p.saved(len(samples)))
    return best if best.length >= MIN_SHARED_PREFIX and len(best.rows) < len(samples) else Prefixes()


def _common_prefix(samples: Sequence[Sample], limit: int) -> Prefixes:
    """The leading tokens every sample shares, at most `limit`."""
    first = samples[0].tokens
    length = min(limit, *(len(s.tokens) for s in samples))
    for s in samples[1:]:
        length = next((i for i in range(length) if s.tokens[i] != first[i]), length)
    return Prefixes(length)


def _distinct_prefixes(samples: Sequence[Sample], limit: int) -> Prefixes:
    """Each sample's first `limit` tokens, computed once per distinct sequence."""
    index: dict[tuple[int, ...], int] = {}
    rows: list[int] = []
    for row, sample in enumerate(samples):
        if index.setdefault(sample.tokens[:limit], len(rows)) == len(rows):
            rows.append(row)
    of = tuple(index[s.tokens[:limit]] for s in samples)
    return Prefixes(limit, tuple(rows), of if len(rows) > 1 else ())


def _multimodal(samples: Sequence[Sample], device: torch.device | str) -> dict[str, torch.Tensor] | None:
    inputs = [s.multimodal_train_inputs for s in samples if s.multimodal_train_inputs]
    if not inputs:
        return None
    return {key: torch.cat([i[key] for i in inputs]).to(device) for key in ("pixel_values", "image_grid_thw")}


def _vision_kwargs(model: Model, batch: Collated) -> dict[str, Any]:
    """Pixels, grids and the image-token mask for a batch with images (nothing for text batches)."""
    if batch.multimodal is None:
        return {}
    config = getattr(model, "module", model).config  # type: ignore[attr-defined] - DeepSpeed wraps the model
    return {**batch.multimodal, "mm_token_type_ids": (batch.input_ids == config.image_token_id).int()}


def _row(s: Sample, length: int, width: int, start: int, pad_id: int) -> tuple[list, ...]:
    """Padded lists of one sample: ids, attention, index, targets, loss mask, rollout logprobs."""
    pad, gap, size = length - len(s.tokens), width - s.response_length, s.response_length
    ids = list(s.tokens) + [pad_id] * pad
    attention = [1] * len(s.tokens) + [0] * pad
    index = [s.prompt_length - 1 - start + j for j in range(size)] + [0] * gap
    targets = list(s.tokens[s.prompt_length :]) + [0] * gap
    return ids, attention, index, targets, list(s.loss_mask) + [0] * gap, list(s.rollout_logprobs) + [0.0] * gap


def response_logprobs(
    model: Model, batch: Collated, temperature: float, entropy: Entropy = "none", autocast: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T] logprobs of the response tokens, engine-style, and their entropy unless `entropy` is "none".

    "metric" returns a detached entropy (no autograd graph is kept for it); "train" keeps its gradient.
    `autocast` runs the model's forward in that mixed-precision dtype (see the module).
    """
    if batch.tree is not None and supports_trees(model):
        return _tree_logprobs(model, batch, batch.tree, temperature, entropy, autocast)
    dtype = autocast_dtype(autocast)
    with torch.autocast(batch.input_ids.device.type, dtype=dtype, enabled=dtype is not None):
        logits = _forward(model, batch).logits  # type: ignore[attr-defined]
    offsets = torch.arange(logits.shape[0], device=logits.device).unsqueeze(1) * logits.shape[1]
    return token_logprobs(logits.flatten(0, 1), batch.index + offsets, batch.targets, temperature, entropy)


def _tree_logprobs(model: Model, batch: Collated, tree: TreeBatch, temperature: float, entropy: Entropy,
                   autocast: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` through the packed trees: each predicting node's log-softmax once, gathered per row."""
    dtype = autocast_dtype(autocast)
    with torch.autocast(tree.input_ids.device.type, dtype=dtype, enabled=dtype is not None):
        logits = tree_logits(model, tree)
    return token_logprobs(logits, tree.nodes[tree.slot], batch.targets, temperature, entropy)


def _forward(model: Model, batch: Collated) -> object:
    """The model's output for `batch`'s kept positions, through the shared prefix when there is one."""
    if batch.shared == 0 or _is_vision(model):
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=batch.keep,
                     use_cache=False, **_vision_kwargs(model, batch))
    cache = DynamicCache()
    key = cache_argument(model)  # type: ignore[arg-type] - a DeepSpeed engine too
    prefix = batch.input_ids[list(batch.prefix_rows), : batch.shared]
    model(input_ids=prefix, logits_to_keep=1, use_cache=True, **{key: cache})
    for layer in cache.layers:
        layer.keys, layer.values = _to_rows(layer.keys, batch), _to_rows(layer.values, batch)
    return model(input_ids=batch.input_ids[:, batch.shared :], attention_mask=batch.attention_mask,
                 logits_to_keep=batch.keep, use_cache=True, **{key: cache})


def _to_rows(prefix: torch.Tensor, batch: Collated) -> torch.Tensor:
    """A prefix batch's keys or values, one copy per row: a view for one prefix, a gather for several."""
    if not batch.prefix_of:
        return prefix.expand(batch.input_ids.shape[0], -1, -1, -1)
    return prefix.index_select(0, torch.tensor(batch.prefix_of, device=prefix.device))


def _is_vision(model: Model) -> bool:
    """Whether `model` is a vision-language model (its rope positions are not plain offsets past a cache)."""
    return hasattr(getattr(getattr(model, "module", model), "config", None), "vision_config")


@dataclass
class _Prepared:
    """Per micro-batch tensors computed before any update of this step."""

    batch: Collated
    old: torch.Tensor
    ref: torch.Tensor | None
    teacher: torch.Tensor | None
    advantages: torch.Tensor


@dataclass(frozen=True)
class Frozen:
    """The models a step reads without training them: the KL reference and the distillation teacher."""

    reference: Model | None = None
    teacher: Model | None = None


def optimizer_step(
    model: Model,
    frozen: Frozen,
    backend: Backend,
    samples: Sequence[Sample],
    settings: StepSettings,
    pad_id: int,
    device: torch.device | str,
    version: int | None = None,
    timeline: list[MicroBatchTime] | None = None,
) -> dict[str, float]:
    """One optimizer step over `samples` (a global batch) in one process; returns its metrics (no `train/`).
    `version` (the weight version being trained) adds the KL per lag bucket (`version_lag_kl/<k>`); `timeline`
    gets each micro-batch's times."""
    share = shard(samples, 1, settings.batching, version)[0]
    return share_step(model, frozen, backend, share, settings, pad_id, device, timeline=timeline)


def share_step(
    model: Model,
    frozen: Frozen,
    backend: Backend,
    share: RankShare,
    settings: StepSettings,
    pad_id: int,
    device: torch.device | str,
    all_sum: AllSum | None = None,
    timeline: list[MicroBatchTime] | None = None,
) -> dict[str, float]:
    """One optimizer step over this rank's `share` of a global batch; `all_sum` (None: one rank) makes the
    whitening and the metrics cover every rank (train/data_parallel.py). Metrics are the global batch's. `timeline`
    (when given) gets when each micro-batch ran and its samples."""
    mode = "auto" if settings.batching.tree else "off"
    batches = [collate(g, pad_id, device, mode) for g in share.micro_batches]
    prepared = _prepare(model, frozen, batches, settings, all_sum)
    metrics: dict[str, float] = {}
    for i, item in enumerate(prepared):
        started = time.time_ns()
        loss, values, logprobs = _micro_loss(model, item, settings, share.tokens, share.sequences)
        backend.backward(loss, last=i == len(prepared) - 1)
        if timeline is not None:
            timeline.append(MicroBatchTime(i, started, time.time_ns(), share.micro_batches[i]))
        _accumulate(metrics, {"loss": float(loss.detach()), **values})
        if share.version is not None:
            _accumulate(metrics, lag_kl_sums(share.micro_batches[i], share.version, logprobs,
                                             item.batch.rollout_logprobs, item.batch.loss_mask))
    if frozen.reference is not None and not settings.loss.use_kl_loss:
        metrics["kl"] = _shaping_kl(prepared, share.tokens)
    if all_sum is not None:
        metrics = sum_metrics(metrics, all_sum)
    metrics = lag_kl_metrics(metrics)
    metrics["grad_norm"] = backend.step()
    return metrics


def _micro_loss(
    model: Model, item: _Prepared, settings: StepSettings, tokens: float, seqs: float
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """Forward with gradient and the policy loss of one micro-batch; its metrics and the policy's logprobs."""
    mode: Entropy = "train" if settings.loss.entropy_coef > 0 else "metric"
    logprobs, entropy = response_logprobs(model, item.batch, settings.temperature, mode, settings.autocast)
    loss_batch = LossBatch(
        logprobs=logprobs,
        old_logprobs=item.old,
        rollout_logprobs=item.batch.rollout_logprobs,
        advantages=item.advantages,
        loss_mask=item.batch.loss_mask,
        entropy=entropy,
        ref_logprobs=item.ref,
        teacher_logprobs=item.teacher,
        token_normalizer=tokens,
        seq_normalizer=seqs,
    )
    return (*policy_loss(loss_batch, settings.loss), logprobs)


def _prepare(model: Model, frozen: Frozen, batches: list[Collated], settings: StepSettings,
             all_sum: AllSum | None = None) -> list[_Prepared]:
    """Old, reference and teacher logprobs without gradient, then token advantages (whitened over the global
    batch)."""
    with torch.no_grad():
        olds = [_old_logprobs(model, b, settings) for b in batches]
        refs = [_frozen_logprobs(frozen.reference, b, settings) for b in batches]
        teachers = [_frozen_logprobs(frozen.teacher, b, settings) for b in batches]
    advantages = [_token_advantages(b, o, r, settings) for b, o, r in zip(batches, olds, refs, strict=True)]
    if settings.advantages.normalize_advantages:
        advantages = _whiten_all(advantages, [b.loss_mask for b in batches], all_sum)
    return [_Prepared(*parts) for parts in zip(batches, olds, refs, teachers, advantages, strict=True)]


def _frozen_logprobs(frozen: Model | None, batch: Collated, settings: StepSettings) -> torch.Tensor | None:
    return _logprobs(frozen, batch, settings) if frozen is not None else None


def _old_logprobs(model: Model, batch: Collated, settings: StepSettings) -> torch.Tensor:
    return batch.rollout_logprobs if settings.loss.use_rollout_logprobs else _logprobs(model, batch, settings)


def _logprobs(model: Model, batch: Collated, settings: StepSettings) -> torch.Tensor:
    return response_logprobs(model, batch, settings.temperature, autocast=settings.autocast)[0]


def _token_advantages(
    batch: Collated, old: torch.Tensor, ref: torch.Tensor | None, settings: StepSettings
) -> torch.Tensor:
    """Base scalars over tokens; the KL handed to reinforce++ shaping is the old policy's k1 to the reference."""
    credit = settings.advantages
    shaping = ref is not None and credit.kl_coef > 0
    kl = (old - ref) if shaping else None
    return token_advantages(batch.base, batch.loss_mask, credit.estimator, kl=kl,
                            kl_coef=credit.kl_coef if shaping else 0.0)


def _whiten_all(advantages: list[torch.Tensor], masks: list[torch.Tensor],
                all_sum: AllSum | None = None) -> list[torch.Tensor]:
    """Whiten over every mask-1 token of the global batch (on every rank with `all_sum`), then cut back into
    micro-batches."""
    width = max(a.shape[1] for a in advantages)
    pad = [torch.nn.functional.pad(a, (0, width - a.shape[1])) for a in advantages]
    mask = [torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks]
    white = whiten(torch.cat(pad), torch.cat(mask)) if all_sum is None else whiten_across(
        torch.cat(pad), torch.cat(mask), all_sum)
    rows = [a.shape[0] for a in advantages]
    return [w[:, : a.shape[1]] for w, a in zip(white.split(rows), advantages, strict=True)]


def _shaping_kl(prepared: list[_Prepared], tokens: float) -> float:
    """Mean k1 KL (old policy to reference) over the mask-1 tokens, reported when KL shapes the reward."""
    total = sum(float(((p.old - p.ref) * p.batch.loss_mask).sum()) for p in prepared if p.ref is not None)
    return total / tokens


def _accumulate(into: dict[str, float], values: dict[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + value


def mean_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the optimizer steps that reported it (non-finite values stay visible)."""
    keys = sorted({k for s in steps for k in s})
    return {k: math.fsum(s[k] for s in steps if k in s) / sum(k in s for s in steps) for k in keys}
