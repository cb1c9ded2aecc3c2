"""Rows that share leading tokens as one prefix tree: which rows form a tree, and what a tree costs to compute.

A training row is a root-to-leaf chain of tokens. Rows that start with the same tokens (the leaves of one forked
session, the samples of one GRPO group) are the paths of a prefix tree (a trie): each node is one token at one
depth, and a row is the path of nodes of its tokens. `PrefixTree` is that tree over a list of rows: for each
node its token, its parent and its depth (its position in every row through it), and for each row its path.
Nodes are numbered in insertion order, so a node's parent always comes before it and a row's new nodes after
the fork are consecutive (the attention mask is built per such run, `runs`).

Which rows form one tree is a cost decision (`tree_groups`): a packed tree row of n tokens costs its n tokens'
linear layers plus n × n attention pairs, so merging rows that share little into one long tree row can cost
more than it saves. `cost(queries, keys)` is the model of that: queries + queries × keys / `ATTENTION_WIDTH`.
Rows join, in order, the tree that saves the most, or start their own. `tree_groups(rows, limit)` also caps a
tree's nodes (`TREE_ROW_NODES` for the packed forward): a tree row's eager attention holds [heads, n, n]
probabilities per layer for the backward, which grow with the tree row's length squared.
A tree passes the cap only while its attention is no larger than its own rows' would be (n² at most the sum of
their squared lengths): a forked session's leaves, long rows that share most of their tokens, stay one tree (what
tree training is for), while short rows that share a preamble (GRPO groups) do not grow one long row. Capped, a row
that would grow its best tree past the limit joins another or starts its own (its shared prefix then runs once
more), and attention memory grows with the capped row's length squared.

What this module does not do: tensors, masks or models (train/tree_batch.py packs a tree for the forward), or
decide the loss: every row keeps its own response positions, so its reductions are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ATTENTION_WIDTH = 2048
"""Keys per query at which a row's attention costs about what its linear layers cost (per token per layer:
SmolLM2-135M's projections and MLP are 3.5 M multiply-adds, its attention 2 × 576 a key, so about 3000; the
tiny test model's about 1000). Only the choice of packing depends on it, never a result."""

TREE_ROW_NODES = 256
"""The most nodes `step.collate` packs into one tree row (a longer row is a tree of its own): one SmolLM2 GRPO
group (a prompt of about 50 tokens and 8 answers of up to 16) fits whole, so only prefixes shared across groups
(the chat preamble) run more than once."""

Tokens = Sequence[int]


def cost(queries: int, keys: int) -> float:
    """What a row of `queries` tokens attending to `keys` tokens costs, in token-equivalents of linear layers."""
    return queries + queries * keys / ATTENTION_WIDTH


@dataclass(frozen=True)
class PrefixTree:
    """The distinct prefixes of some rows as one tree; connects `build_tree` to the packed tree batch."""

    tokens: tuple[int, ...]
    """Token id of each node."""
    parents: tuple[int, ...]
    """Each node's parent (-1 for a root; a tree over rows with different first tokens has several roots)."""
    depths: tuple[int, ...]
    """Each node's depth: its position (0-based) in every row that runs through it."""
    paths: tuple[tuple[int, ...], ...]
    """Per row, the node of each of its tokens."""

    @property
    def size(self) -> int:
        """Tokens the tree computes (each shared prefix once)."""
        return len(self.tokens)

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs [start, end) of nodes each of whose parent is the node before it (after the first)."""
        starts = [i for i in range(self.size) if i == 0 or self.parents[i] != i - 1]
        return list(zip(starts, [*starts[1:], self.size], strict=True))


class TrieBuilder:
    """A prefix tree grown row by row; `shared(tokens)` says how many leading tokens a row would reuse."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.paths: list[tuple[int, ...]] = []
        self.squares = 0
        """The sum of the rows' squared lengths: their attention pairs as rows of their own."""

    @property
    def size(self) -> int:
        return len(self.tokens)

    def shared(self, tokens: Tokens) -> int:
        """Leading tokens of `tokens` already in the tree."""
        node = -1
        for depth, token in enumerate(tokens):
            node = self.children.get((node, token), -2)
            if node == -2:
                return depth
        return len(tokens)

    def add(self, tokens: Tokens) -> None:
        """Insert one row, creating the nodes of its tokens past the longest prefix already present."""
        node, path = -1, []
        for depth, token in enumerate(tokens):
            child = self.children.get((node, token))
            if child is None:
                child = self.children[(node, token)] = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
            path.append(child)
            node = child
        self.paths.append(tuple(path))
        self.squares += len(tokens) * len(tokens)

    def tree(self, rows: Sequence[int] | None = None) -> PrefixTree:
        """The tree so far; `rows`: the index of each inserted row, whose paths are then listed in index order."""
        paths = self.paths if rows is None else [path for _, path in sorted(zip(rows, self.paths, strict=True))]
        return PrefixTree(tuple(self.tokens), tuple(self.parents), tuple(self.depths), tuple(paths))


def build_tree(rows: Sequence[Tokens]) -> PrefixTree:
    """The prefix tree of `rows`, in order."""
    builder = TrieBuilder()
    for row in rows:
        builder.add(row)
    return builder.tree()


@dataclass(frozen=True)
class TreeGroup:
    """Rows packed as one tree; connects `tree_groups` to the micro-batch packing and the tree batch."""

    rows: tuple[int, ...]
    """Indices of the rows, in order."""
    tree: PrefixTree


def tree_groups(rows: Sequence[Tokens], limit: int | None = None) -> list[TreeGroup]:
    """Rows grouped into trees (each group's rows in order, groups by their first row): longest first, each row
    joins the tree where adding it saves the most `cost` against a row of its own, or starts a new tree when none
    saves, so a forked session's longest leaf starts its tree and its shorter leaves join it. With `limit`, a row
    joins only a tree that stays within `limit` nodes or whose attention stays no larger than its rows' own (see
    the module)."""
    builders: list[TrieBuilder] = []
    members: list[list[int]] = []
    for index in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        row = rows[index]
        savings = [_join_saving(b.size, len(row), b.shared(row), limit, b.squares) for b in builders]
        best = max(range(len(builders)), key=savings.__getitem__, default=-1)
        if best < 0 or savings[best] <= 0:
            builders.append(TrieBuilder())
            members.append([])
            best = len(builders) - 1
        builders[best].add(row)
        members[best].append(index)
    groups = [TreeGroup(tuple(sorted(m)), b.tree(m)) for m, b in zip(members, builders, strict=True)]
    return sorted(groups, key=lambda g: g.rows)


def _join_saving(size: int, length: int, shared: int, limit: int | None = None, squares: int = 0) -> float:
    """Cost saved by adding a row of `length` tokens (`shared` already present) to a tree of `size` nodes whose
    rows' squared lengths sum to `squares`; nothing (0) when the grown tree would pass `limit` nodes with more
    attention pairs than its rows have (grown² > squares + length²)."""
    grown = size + length - shared
    if limit is not None and grown > limit and grown * grown > squares + length * length:
        return 0.0
    return cost(size, size) + cost(length, length) - cost(grown, grown)
