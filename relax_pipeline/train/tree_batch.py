"""A micro-batch packed as prefix trees: every token of a tree computed once, each row's logprobs read back.

`pack_trees` turns the rows of a micro-batch, grouped into trees (`prefix_tree.tree_groups`), into one packed
row per tree, right-padded to the longest tree: token ids [R, N], position ids [R, N] (a node's depth, which is
its position in every row through it, so the rotary positions are the per-row path's), and an ancestor mask
[R, 1, N, N] that lets each node attend to itself and its ancestors only, so every branch sees exactly the
tokens its rows see. Padding nodes attend to themselves only (no row reads them).

The logits are kept only at the nodes that predict some row's response token (`keep`, the union of those
columns); each distinct predicting node's log-softmax is computed once (`nodes`, rows of the flattened kept
logits), and `slot` [B, T] says which of them predicts response token j of row b. The step's `token_logprobs`
then reads the very [B, T] logprobs (and entropies) the per-row path computes, so the loss, its reductions, the
advantages and every metric run unchanged on them; a node shared by k rows appears k times in that [B, T] view,
and its backward sums the k gradients into the node's row: the multiplicity weighting is the gather's backward.

Attention kernels: transformers passes a 4-D mask through unchanged; `sdpa` takes it as booleans (True:
attend), `eager` and `grouped` as an additive float mask (0 or the dtype's minimum). Other kernels (flash
attention) take no arbitrary mask: `supports_trees` says so and the step falls back to the per-row path.

What this module does not do: choose between the tree and the per-row packing (train/step.py's `collate`
does, by `prefix_tree.cost`), images (vision models' rope positions are not depths; they stay per row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.prefix_tree import PrefixTree, TreeGroup

MASKED_KERNELS = ("sdpa", "eager", "grouped")
"""Attention implementations that take a custom 4-D mask."""


@dataclass(frozen=True)
class TreeBatch:
    """One micro-batch as packed trees; connects `pack_trees` to the forward (`tree_logprobs`)."""

    input_ids: torch.Tensor
    """[R, N] node token ids, one packed row per tree (padding: the pad id)."""
    positions: torch.Tensor
    """[R, N] node depths (padding: 0)."""
    ancestors: torch.Tensor
    """[R, 1, N, N] bool: True where the query node may attend to the key node (itself or an ancestor)."""
    keep: torch.Tensor
    """[K] columns whose logits are computed (every column holding a node that predicts a response token)."""
    nodes: torch.Tensor
    """[M] distinct predicting nodes, as flat indices into the kept logits [R * K]."""
    slot: torch.Tensor
    """[B, T] index into `nodes` of the node predicting row b's response token j (0 on padding)."""
    computed: int
    """Tree tokens the forward computes (padding excluded)."""


def supports_trees(model: object) -> bool:
    """Whether `model`'s attention kernel takes a custom 4-D mask (DeepSpeed engines are unwrapped)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) in MASKED_KERNELS and not hasattr(config, "vision_config")


def pack_trees(samples: Sequence[Sample], groups: Sequence[TreeGroup], width: int, pad_id: int,
               device: torch.device | str) -> TreeBatch:
    """The packed trees of `groups` (every row of `samples` in exactly one); `width` is T of the [B, T] views."""
    length = max(g.tree.size for g in groups)
    ids = torch.full((len(groups), length), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), length), dtype=torch.long)
    ancestors = torch.eye(length, dtype=torch.bool).repeat(len(groups), 1, 1, 1)
    for row, group in enumerate(groups):
        size = group.tree.size
        ids[row, :size] = torch.tensor(group.tree.tokens)
        positions[row, :size] = torch.tensor(group.tree.depths)
        ancestors[row, 0, :size, :size] = ancestor_matrix(group.tree)
    keep, nodes, slot = _predictors(samples, groups, width, length)
    computed = sum(g.tree.size for g in groups)
    return TreeBatch(ids.to(device), positions.to(device), ancestors.to(device), keep.to(device), nodes.to(device),
                     slot.to(device), computed)


def ancestor_matrix(tree: PrefixTree) -> torch.Tensor:
    """[n, n] bool: node i may attend to node j when j is i or an ancestor of i. Built per run of consecutive
    nodes: the run's rows are its first node's parent's row plus the run's own lower triangle."""
    size = tree.size
    matrix = torch.zeros((size, size), dtype=torch.bool)
    for start, end in tree.runs():
        parent = tree.parents[start]
        if parent >= 0:
            matrix[start:end] = matrix[parent]
        matrix[start:end, start:end] |= torch.ones((end - start, end - start), dtype=torch.bool).tril()
    return matrix


def _predictors(samples: Sequence[Sample], groups: Sequence[TreeGroup], width: int,
                length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept columns, distinct predicting nodes (flat indices into [R * K]) and the [B, T] slots into them."""
    packed = torch.full((len(samples), width), -1, dtype=torch.long)
    for row, group in enumerate(groups):
        for index, path in zip(group.rows, group.tree.paths, strict=True):
            sample = samples[index]
            columns = path[sample.prompt_length - 1 : len(sample.tokens) - 1]
            packed[index, : len(columns)] = torch.tensor(columns, dtype=torch.long) + row * length
    real = packed >= 0
    keep = torch.unique(packed[real] % length)
    rank = torch.zeros(length, dtype=torch.long)
    rank[keep] = torch.arange(len(keep))
    flat = torch.where(real, packed // length * len(keep) + rank[packed.clamp(min=0) % length], 0)
    nodes, slot = torch.unique(flat[real], return_inverse=True)
    slots = torch.zeros_like(packed)
    slots[real] = slot
    return keep, nodes, slots


def tree_logits(model: Callable[..., object], batch: TreeBatch) -> torch.Tensor:
    """[R * K, V] logits of the kept columns, from one forward over the packed trees; `nodes` indexes its rows
    (read in place by `token_logprobs`, not copied out)."""
    output = model(input_ids=batch.input_ids, attention_mask=_mask(model, batch), position_ids=batch.positions,
                   logits_to_keep=batch.keep, use_cache=False)
    return output.logits.flatten(0, 1)  # type: ignore[attr-defined]


def _mask(model: object, batch: TreeBatch) -> torch.Tensor:
    """The ancestor mask as the kernel takes it: booleans for sdpa, additive floats for eager kernels."""
    config = getattr(getattr(model, "module", model), "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        return batch.ancestors
    return torch.zeros(batch.ancestors.shape, device=batch.ancestors.device).masked_fill(
        ~batch.ancestors, torch.finfo(torch.float32).min)
