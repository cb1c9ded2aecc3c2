"""Data-parallel training across `trainer.num_ranks` ranks: the split rule and the reductions that keep one
optimizer step exactly equal to the single-rank step on the same global batch.

Split rule (`shard`): sample i of a global batch goes to rank i mod N (round robin in input order, so
every rank holds within one sample of the others). Each rank packs its own samples into micro-batches with
the ordinary rule (`batching.micro_batches`: `micro_batch_size` or `max_tokens_per_gpu` are per rank).
With `trainer.batching.tree` the split keeps prefix trees whole where it can (`_tree_split`): when some rows
share a tree (`prefix_tree.tree_groups` over the global batch), each tree that fits a rank's fair share of tree
tokens goes whole to the rank with the fewest tree tokens so far (largest first, ties to the lower rank), and a
larger tree is dealt row by row, round robin, from the least-loaded rank; a batch whose rows share nothing splits
round robin as above. Each rank then packs its own rows as trees.
Every rank must run the same number of forward/backward passes, because ZeRO reduces gradients (and,
under stage 3, gathers parameters) inside them and collectives must pair up; a rank with fewer
micro-batches gets padding micro-batches of one `padding_sample` (the global batch's shortest sample with
loss mask 0 and advantage 0). Padding runs forward and backward but adds nothing to the loss, the
gradients, the whitening statistics or the metrics.

Exactness: the loss of every micro-batch is divided by the GLOBAL batch's normalizers (`RankShare.tokens`,
`RankShare.sequences`), so the rank losses sum to the single-rank loss; DeepSpeed averages gradients over
ranks, so the backend scales each rank's loss by N before backward (the sum of the rank gradients is the
single-rank gradient). Advantage whitening uses the mean and std of all ranks' mask-1 tokens (`whiten_across`),
and the step's metrics are summed over ranks (`sum_metrics`; every one is a sum of per-micro-batch values
over the global normalizers). Only float summation order differs from one rank.

With several ranks the shares hold lean rows (`training_row`): each sample's tokens, masks, logprobs,
versions, images and advantage, without the messages, context and timings that say where it came from,
since the shares travel pickled to the worker ranks and training reads none of those (one rank ships
nothing and trains on the samples as given).

What this module does not do: start processes, move samples between them, or talk to DeepSpeed; the
`AllSum` callback it is given does the one collective it needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.batching import BatchSettings, micro_batches
from relax_pipeline.train.prefix_tree import tree_groups

AllSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 CPU tensor over every rank (all-reduce SUM) and returns the sum, same shape, on the CPU."""


@dataclass(frozen=True)
class RankShare:
    """One rank's part of one global batch; connects the split on rank 0 to `step.share_step` on each rank."""

    micro_batches: tuple[tuple[Sample, ...], ...]
    """This rank's micro-batches in order, padded to the count every rank runs (at least one)."""
    tokens: float
    """Mask-1 tokens of the whole global batch (at least 1): the token_mean normalizer."""
    sequences: float
    """Samples in the whole global batch: the seq_mean normalizers."""
    padding: int = 0
    """How many of `micro_batches` are padding (loss mask 0); informational."""
    version: int | None = None
    """The weight version being trained, from which each token's lag is taken (`train/version_lag_kl/*`); None:
    no KL per lag."""


def shard(samples: Sequence[Sample], world: int, batching: BatchSettings,
          version: int | None = None) -> list[RankShare]:
    """Split one global batch over `world` ranks (rank r gets samples r, r+N, ...; under `batching.tree`, prefix
    trees whole where they fit, `_tree_split`); one share per rank, each naming the weight `version` being trained."""
    if world < 1:
        raise ValueError(f"trainer.num_ranks={world}; use 1 or more")
    if not samples:
        raise ValueError("shard needs a non-empty global batch")
    tokens = max(1.0, float(sum(sum(s.loss_mask) for s in samples)))
    samples = [training_row(s) for s in samples] if world > 1 else list(samples)
    parts = _tree_split(samples, world) if batching.tree and world > 1 else None
    packed = [micro_batches(parts[rank] if parts else samples[rank::world], batching) for rank in range(world)]
    count = max(len(p) for p in packed)
    pad = (padding_sample(samples),)
    return [
        RankShare(tuple(tuple(b) for b in p) + (pad,) * (count - len(p)), tokens, float(len(samples)), count - len(p),
                  version)
        for p in packed
    ]


def _tree_split(samples: Sequence[Sample], world: int) -> list[list[Sample]] | None:
    """Rows per rank keeping trees whole (see the module); None when no two rows share a tree."""
    groups = tree_groups([s.tokens for s in samples])
    if len(groups) == len(samples):
        return None
    fair = sum(g.tree.size for g in groups) / world
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for group in sorted(groups, key=lambda g: -g.tree.size):
        start = min(range(world), key=loads.__getitem__)
        if group.tree.size <= fair:
            parts[start].extend(group.rows)
            loads[start] += group.tree.size
            continue
        for offset, index in enumerate(group.rows):
            parts[(start + offset) % world].append(index)
            loads[(start + offset) % world] += len(samples[index].tokens)
    return [[samples[i] for i in sorted(part)] for part in parts]


def training_row(sample: Sample) -> Sample:
    """What a rank trains on: `sample`'s tokens, masks, logprobs, versions, images and advantage, and nothing
    of where it came from (messages, context, hash, timings)."""
    return Sample(sample.tokens, sample.prompt_length, sample.loss_mask, sample.rollout_logprobs,
                  sample.weight_versions, multimodal_train_inputs=sample.multimodal_train_inputs,
                  advantage=sample.advantage)


def padding_sample(samples: Sequence[Sample]) -> Sample:
    """The shortest sample with loss mask 0, rollout logprobs 0 and advantage 0: a pass that trains nothing."""
    short = min(samples, key=lambda s: len(s.tokens))
    size = short.response_length
    return replace(short, loss_mask=(0,) * size, rollout_logprobs=(0.0,) * size, advantage=0.0)


def whiten_across(advantages: torch.Tensor, loss_mask: torch.Tensor, all_sum: AllSum,
                  eps: float = 1e-8) -> torch.Tensor:
    """`advantages.whiten` over every rank's mask-1 tokens: global mean, unbiased global std (two passes)."""
    valid = loss_mask > 0
    values = advantages[valid].double()
    count, total = all_sum(torch.stack([values.new_tensor(float(values.numel())), values.sum()])).tolist()
    if count < 2:
        return torch.zeros_like(advantages)
    mean = total / count
    squares = float(all_sum(((values - mean) ** 2).sum().reshape(1))[0])
    std = math.sqrt(squares / (count - 1))
    return torch.where(valid, (advantages - mean) / (std + eps), 0.0).to(advantages.dtype)


def sum_metrics(metrics: dict[str, float], all_sum: AllSum) -> dict[str, float]:
    """Every metric summed over ranks (each rank reports the same keys, in any order)."""
    keys = sorted(metrics)
    summed = all_sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64)).tolist()
    return dict(zip(keys, summed, strict=True))
