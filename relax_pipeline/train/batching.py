"""How a rollout batch is cut into optimizer steps and micro-batches.

The trainer's rows are the forest's credited samples (`forest.sample.Sample` with `advantage` set: tokens,
response-aligned loss mask and rollout logprobs, base advantage); `global_batches`, the trainer's entry,
refuses a sample without an advantage. `BatchSettings` is the `trainer.batching` node.
`global_batches` splits a rollout batch into optimizer steps of `global_batch_size` samples in the given
order (None: one step; a short remainder is its own, smaller step, never dropped). `micro_batches` packs
one global batch into forward/backward passes: fixed-size chunks in order, or, with dynamic batching,
first-fit-decreasing by token count.

The dynamic budget counts PADDED tokens (`rows × longest row`), because the backends run right-padded
[B, L] batches: that is what a forward pass really costs in memory. Samples are placed longest first
(ties keep their input order), each into the first micro-batch where it fits, so the result is
deterministic. A sample longer than the budget gets a micro-batch of its own and a warning; nothing is
ever dropped.

With `tree` (`trainer.batching.tree`, on by default) the rows that share leading tokens form prefix trees
(`prefix_tree.tree_groups`: a forked session's leaves, a GRPO group) and a tree's rows stay in one micro-batch:
fixed-size chunks take the rows tree by tree (each tree in the order of its first row), and dynamic batching
packs whole trees first-fit-decreasing, counting a micro-batch as its trees × the largest tree's tokens (the
packed [R, N] batch `tree_batch.pack_trees` builds); a tree over the budget is cut, in row order, into parts
that fit. Rows that share nothing are one-row trees, packed exactly as without `tree`.

Samples of vision-language models carry `multimodal_train_inputs` (`pixel_values`, `image_grid_thw`);
their `tokens` are the processor-expanded ids, so the padded-token budget counts image tokens too.

What this module does not do: tensors, padding, normalizers (see `step.py`), or data-parallel sharding
across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.prefix_tree import TrieBuilder, tree_groups

log = logging.getLogger(__name__)


@dataclass
class BatchSettings:
    """The `trainer.batching` node; connects the `trainer` config group to `global_batches`/`micro_batches`.

    Not frozen: OmegaConf turns frozen dataclasses into read-only nodes, which overrides could not change.
    """

    global_batch_size: int | None = None
    """Samples per optimizer step; None means one optimizer step over the whole rollout batch."""
    micro_batch_size: int = 8
    """Samples per forward/backward when dynamic batching is off."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count (required when a session exports several contexts)."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one packed micro-batch under dynamic batching."""
    tree: bool = True
    """Pack rows that share leading tokens (a forked session's leaves, a GRPO group) as prefix trees, computing
    each shared token once (train/tree_batch.py), wherever that costs less than the padded rows; the logprobs,
    loss, gradients and metrics are the per-row path's (float summation order aside). Vision models stay per row."""

    def __post_init__(self) -> None:
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"trainer.batching.global_batch_size={self.global_batch_size}; "
                             "use null or a positive number")
        for key in ("micro_batch_size", "max_tokens_per_gpu"):
            if getattr(self, key) <= 0:
                raise ValueError(f"trainer.batching.{key}={getattr(self, key)}; use a positive number")


def global_batches(samples: Sequence[Sample], batching: BatchSettings) -> list[list[Sample]]:
    """Optimizer steps in input order: chunks of `global_batch_size` (None: one step of everything)."""
    _require_credit(samples)
    if batching.global_batch_size is None:
        return [list(samples)] if samples else []
    return _chunks(samples, batching.global_batch_size)


def micro_batches(samples: Sequence[Sample], batching: BatchSettings) -> list[list[Sample]]:
    """Pack one global batch into micro-batches: fixed-size chunks, or FFD by padded token count. With
    `tree`, the rows of one prefix tree stay together: trees in order of their first row for chunks, and
    under dynamic batching whole trees packed by their tree tokens (`_tree_bins`)."""
    if batching.tree and batching.use_dynamic_batch_size:
        return _tree_bins(samples, batching.max_tokens_per_gpu)
    if batching.tree:
        samples = [samples[i] for g in tree_groups([s.tokens for s in samples]) for i in g.rows]
    if not batching.use_dynamic_batch_size:
        return _chunks(samples, batching.micro_batch_size)
    return _first_fit_decreasing(samples, batching.max_tokens_per_gpu)


def _tree_bins(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """Trees (cut to fit `budget` tree tokens) first-fit-decreasing into micro-batches of at most `budget`
    packed tokens (trees × the largest tree), or of the rows' padded tokens when that is less."""
    for index, sample in enumerate(samples):
        _warn_if_oversized(sample, index, budget)
    groups = tree_groups([s.tokens for s in samples])
    units = [part for g in groups for part in _fitting([samples[i] for i in g.rows], budget)]
    order = sorted(range(len(units)), key=lambda i: -units[i][1])
    bins: list[list[tuple[list[Sample], int]]] = []
    for index in order:
        target = next((b for b in bins if _tree_fits(b, units[index], budget)), None)
        if target is None:
            bins.append([units[index]])
        else:
            target.append(units[index])
    return [[s for rows, _ in b for s in rows] for b in bins]


def _fitting(rows: list[Sample], budget: int) -> list[tuple[list[Sample], int]]:
    """A tree's rows in order, cut into parts of at most `budget` tree tokens (a longer row: a part alone)."""
    parts: list[tuple[list[Sample], int]] = [([], 0)]
    builder = TrieBuilder()
    for row in rows:
        if parts[-1][0] and builder.size + len(row.tokens) - builder.shared(row.tokens) > budget:
            builder = TrieBuilder()
            parts.append(([], 0))
        builder.add(row.tokens)
        parts[-1] = ([*parts[-1][0], row], builder.size)
    return parts


def _tree_fits(bin_: list[tuple[list[Sample], int]], unit: tuple[list[Sample], int], budget: int) -> bool:
    """Trees are placed largest first, so a bin's first tree is its largest."""
    return (len(bin_) + 1) * max(bin_[0][1], unit[1]) <= budget


def padded_tokens(samples: Sequence[Sample]) -> int:
    """Tokens a right-padded [B, L] batch of `samples` holds: rows × longest row."""
    return len(samples) * max((len(s.tokens) for s in samples), default=0)


def _require_credit(samples: Sequence[Sample]) -> None:
    """Refuse a sample without an advantage, naming its index (the trainer trains credited samples only)."""
    uncredited = next((i for i, s in enumerate(samples) if s.advantage is None), None)
    if uncredited is not None:
        raise ValueError(f"sample {uncredited} has no advantage (Sample.advantage is None); train on credited "
                         "samples only: dataclasses.replace(sample, advantage=...)")


def _chunks(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def _first_fit_decreasing(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """Longest first (stable), each into the first bin whose padded size stays within `budget`."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    bins: list[list[Sample]] = []
    for index in order:
        sample = samples[index]
        target = next((b for b in bins if _fits(b, sample, budget)), None)
        if target is None:
            _warn_if_oversized(sample, index, budget)
            bins.append([sample])
        else:
            target.append(sample)
    return bins


def _fits(bin_: list[Sample], sample: Sample, budget: int) -> bool:
    """Bins are filled longest first, so a bin's first sample is its longest row."""
    longest = max(len(bin_[0].tokens), len(sample.tokens))
    return (len(bin_) + 1) * longest <= budget


def _warn_if_oversized(sample: Sample, index: int, budget: int) -> None:
    if len(sample.tokens) > budget:
        log.warning(
            "sample %d has %d tokens, more than trainer.batching.max_tokens_per_gpu=%d; it trains in a micro-batch "
            "of its own",
            index,
            len(sample.tokens),
            budget,
        )
