"""The embedded engine's prefix KV cache: a radix tree over token ids, bounded in bytes, evicted LRU.

`PrefixCache` maps token sequences to the key/value tensors a forward pass computed for them, so a request
whose prompt starts with a cached sequence prefills only the rest. It is session-agnostic: the samples of a
GRPO group hit their shared prompt (and every prompt hits the chat template's system preamble), and a
session's next turn (previous prompt + generated tokens + observation) hits the previous turn's whole
sequence. Each tree edge holds the KV of its tokens as one tensor `[layers, 2 (key, value), kv_heads,
tokens, head_dim]`; `match` returns the pieces along the longest cached path (an edge may match in part),
`insert` stores what is new and splits an edge where two sequences part.

Invariant: the KV stored for a node is what the model computed for exactly the tokens on the path from the
root, under the weights of the current `epoch`; `clear()` (weight update, memory pressure) drops it all.
Bound: after each insert, least-recently-used leaves are evicted until the stored tensors fit in
`budget_bytes` (a path touched by `match`/`insert` is used as a whole, so parents outlive their children;
the last leaf evicted keeps its head when dropping its tail is enough); a budget of 0 disables the cache.
`shared_prefixes` finds the prefixes that several prompts of one admission round share, so the scheduler
can compute each of them once; `buckets` groups a round's prompts into forward passes by length.

Not done here: running the model or laying KV out into a batch (`hf/batch.py`), deciding when to match or
insert (`engine.py`). Images are not part of the key, so requests with media bypass the cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Tokens = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    """One edge of the tree: its tokens, their KV `[layers, 2, heads, len(tokens), dim]`, its children."""

    tokens: Tokens
    kv: torch.Tensor | None
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    used: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class Hit:
    """The longest cached prefix of a sequence: its length and the KV pieces along it, in order."""

    length: int
    pieces: tuple[torch.Tensor, ...] = ()


def common_len(label: Tokens, tokens: Tokens, start: int, stop: int) -> int:
    """How many leading tokens of `label` equal `tokens[start:stop]`."""
    size = min(len(label), stop - start)
    if label[:size] == tokens[start : start + size]:
        return size
    return next(i for i in range(size) if label[i] != tokens[start + i])


class PrefixCache:
    """Radix tree of token ids → KV tensors within `budget_bytes`; used by one thread (the engine worker)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.nbytes = 0
        self.epoch = 0
        """Bumped by `clear`: KV computed in an earlier epoch must not be inserted."""
        self._root = _Node((), None, None)
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def match(self, tokens: Tokens, limit: int | None = None) -> Hit:
        """The longest cached prefix of `tokens[:limit]`; touches the path it used."""
        stop = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, pieces, tick = self._root, 0, [], next(self._clock)
        while pos < stop and (child := node.children.get(tokens[pos])) is not None:
            size = common_len(child.tokens, tokens, pos, stop)
            child.used = tick
            assert child.kv is not None
            pieces.append(child.kv if size == len(child.tokens) else child.kv[:, :, :, :size])
            pos += size
            if size < len(child.tokens):
                break
            node = child
        return Hit(pos, tuple(pieces))

    def match_len(self, tokens: Tokens, limit: int | None = None) -> int:
        """Length of the longest cached prefix of `tokens[:limit]`, without reading any tensor."""
        return self.match(tokens, limit).length

    def insert(self, tokens: Tokens, kv: torch.Tensor, start: int = 0) -> None:
        """Store `kv` (`[layers, 2, heads, len(tokens) - start, dim]`, the KV of `tokens[start:]`) where the
        tree lacks it; nothing is stored when the tree no longer holds `tokens[:start]`."""
        if not self.enabled or len(tokens) <= start:
            return
        node, pos, tick = self._root, 0, next(self._clock)
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            size = common_len(child.tokens, tokens, pos, len(tokens))
            if size < len(child.tokens) and pos + size < len(tokens):
                child = self._split(child, size)
            child.used = tick
            if size < len(child.tokens):
                return  # `tokens` ends inside this edge: all of it is cached already
            node, pos = child, pos + size
        if pos < start or pos == len(tokens):
            return
        leaf = _Node(tokens[pos:], kv[:, :, :, pos - start :].clone(), node, used=tick)
        node.children[tokens[pos]] = leaf
        self.nbytes += leaf.nbytes
        self._evict()

    def clear(self) -> None:
        """Drop every entry (weights changed, or memory runs short) and start a new epoch."""
        self._root = _Node((), None, None)
        self.nbytes = 0
        self.epoch += 1

    def _split(self, child: _Node, size: int) -> _Node:
        """Cut `child`'s edge after `size` tokens; return the new upper node."""
        assert child.kv is not None and child.parent is not None
        upper = _Node(child.tokens[:size], child.kv[:, :, :, :size].clone(), child.parent, used=child.used)
        upper.children[child.tokens[size]] = child
        child.parent.children[child.tokens[0]] = upper
        child.tokens, child.kv, child.parent = child.tokens[size:], child.kv[:, :, :, size:].clone(), upper
        return upper

    def _evict(self) -> None:
        """Remove least-recently-used leaves until the stored KV fits the budget; the last leaf removed may
        instead lose only its tail (its head is the part other sequences are likelier to share)."""
        if self.nbytes <= self.budget_bytes:
            return
        order = itertools.count()
        heap = [(n.used, next(order), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while self.nbytes > self.budget_bytes and heap:
            _, _, leaf = heapq.heappop(heap)
            if self._trim(leaf, self.nbytes - self.budget_bytes):
                return
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.nbytes -= leaf.nbytes
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.used, next(order), parent))

    def _trim(self, leaf: _Node, excess: int) -> bool:
        """Drop the last tokens of `leaf` worth at least `excess` bytes, if that leaves some of it."""
        assert leaf.kv is not None
        per_token = leaf.nbytes // len(leaf.tokens)
        keep = len(leaf.tokens) - -(-excess // per_token)
        if keep <= 0:
            return False
        self.nbytes -= leaf.nbytes
        leaf.tokens, leaf.kv = leaf.tokens[:keep], leaf.kv[:, :, :, :keep].clone()
        self.nbytes += leaf.nbytes
        return True

    def _nodes(self) -> list[_Node]:
        """Every node but the root."""
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def __len__(self) -> int:
        """Tokens stored (the sum of edge lengths)."""
        return sum(len(n.tokens) for n in self._nodes())


def shared_prefixes(keys: Sequence[Tokens], min_len: int = 1) -> list[Tokens]:
    """The distinct prefixes at which the trie of `keys` branches (each shared by two or more keys), of at
    least `min_len` tokens, shortest first: the longest common prefixes of neighbours in sorted order."""
    ordered = sorted(keys)
    found = {a[: common_len(a, b, 0, len(b))] for a, b in itertools.pairwise(ordered)}
    return sorted((p for p in found if len(p) >= min_len), key=len)


def buckets(sizes: Sequence[int], slack: int = 64) -> list[list[int]]:
    """Indices of `sizes` grouped into forward passes, shortest first, so that left-padding each group to
    its longest member at most doubles its tokens (plus `slack`)."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(sizes)), key=sizes.__getitem__):
        if groups and (len(groups[-1]) + 1) * sizes[i] <= 2 * (total + sizes[i]) + slack:
            groups[-1].append(i)
            total += sizes[i]
        else:
            groups.append([i])
            total = sizes[i]
    return groups
