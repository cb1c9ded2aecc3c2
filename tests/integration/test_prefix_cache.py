"""The embedded engine's prefix KV cache (`engine/hf/prefix_cache.py`) and its batching helpers, on fake KV.

Each fake KV tensor holds, at every token column, that token's id, so the pieces a match returns show which
tokens (in which order) the tree would hand to a prefill. The engine-level checks (same tokens and
logprobs with and without the cache, on the real tiny model) are in `test_hf_engine.py`.
"""

from __future__ import annotations

import torch

from relax_pipeline.engine.hf.batch import TRIM_COLUMNS, Batch, SpareLayer, buckets, fill_from_end, new_cache
from relax_pipeline.engine.hf.prefix_cache import Hit, PrefixCache, shared_prefixes

LAYERS, HEADS, DIM = 2, 1, 3
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4
"""Bytes one token's float32 KV takes in these tests."""


def kv(tokens: tuple[int, ...], start: int = 0) -> torch.Tensor:
    """Fake KV of `tokens[start:]`, `[layers, 2, heads, n, dim]`, every entry of column j = tokens[start + j]."""
    ids = torch.tensor(tokens[start:], dtype=torch.float32)
    return ids.view(1, 1, 1, -1, 1).expand(LAYERS, 2, HEADS, -1, DIM).clone()


def cached_ids(hit: Hit) -> list[int]:
    """The token ids the pieces of `hit` stand for, in order."""
    if not hit.pieces:
        return []
    return torch.cat(hit.pieces, dim=3)[0, 0, 0, :, 0].int().tolist()


def seq(*parts: range | tuple[int, ...]) -> tuple[int, ...]:
    return tuple(t for part in parts for t in part)


A = seq(range(1, 11))
B = seq(range(1, 5), range(50, 56))


def test_match_returns_the_longest_cached_prefix_and_its_kv() -> None:
    cache = PrefixCache(10**6)
    assert cache.match(A) == Hit(0)
    cache.insert(A, kv(A))
    assert cached_ids(cache.match(A)) == list(A)
    assert cache.match(A, limit=7).length == 7 and cached_ids(cache.match(A, limit=7)) == list(A[:7])
    longer = A + (99, 98)
    assert cache.match(longer).length == 10
    assert cache.match((5, 6)).length == 0
    assert cache.nbytes == 10 * TOKEN_BYTES and len(cache) == 10


def test_diverging_sequences_split_an_edge() -> None:
    cache = PrefixCache(10**6)
    cache.insert(A, kv(A))
    cache.insert(B, kv(B))
    assert cached_ids(cache.match(A)) == list(A)
    assert cached_ids(cache.match(B)) == list(B)
    assert cache.match(seq(range(1, 5), (77,))).length == 4
    assert len(cache) == 16 and cache.nbytes == 16 * TOKEN_BYTES
    cache.insert(A[:6], kv(A[:6]))
    assert len(cache) == 16


def test_insert_from_a_start_stores_only_what_is_new() -> None:
    cache = PrefixCache(10**6)
    cache.insert(A, kv(A))
    turn2 = A + (11, 12, 13)
    cache.insert(turn2, kv(turn2, 10), start=10)
    assert cached_ids(cache.match(turn2)) == list(turn2) and len(cache) == 13
    cache.insert(turn2 + (14,), kv(turn2 + (14,), 8), start=8)
    assert cached_ids(cache.match(turn2 + (14,))) == list(turn2 + (14,))
    gap = seq(range(20, 30))
    cache.insert(gap, kv(gap, 5), start=5)
    assert cache.match(gap).length == 0


def test_least_recently_used_leaves_go_first() -> None:
    cache = PrefixCache(25 * TOKEN_BYTES)
    first, second, third, fourth = (seq(range(start, start + 10)) for start in (100, 200, 300, 400))
    cache.insert(first, kv(first))
    cache.insert(second, kv(second))
    cache.match(first)
    cache.insert(third, kv(third))
    assert [cache.match(s).length for s in (first, second, third)] == [10, 5, 10]
    cache.insert(fourth, kv(fourth))
    assert [cache.match(s).length for s in (first, second, third, fourth)] == [0, 5, 10, 10]
    assert cache.nbytes == 25 * TOKEN_BYTES == cache.budget_bytes


def test_parents_outlive_their_children() -> None:
    cache = PrefixCache(13 * TOKEN_BYTES)
    shared = seq(range(1, 9))
    left, right = shared + (60, 61, 62), shared + (70, 71, 72)
    cache.insert(left, kv(left))
    cache.insert(right, kv(right))
    assert cache.match(left).length == 10 and cache.match(right).length == 11
    cache.insert(shared + (80,) * 5, kv(shared + (80,) * 5))
    assert [cache.match(s).length for s in (left, right)] == [8, 8]
    assert cached_ids(cache.match(shared + (80,) * 5)) == list(shared) + [80] * 5


def test_a_sequence_larger_than_the_budget_keeps_its_head() -> None:
    cache = PrefixCache(5 * TOKEN_BYTES)
    cache.insert(A, kv(A))
    assert cached_ids(cache.match(A)) == list(A[:5]) and cache.nbytes == 5 * TOKEN_BYTES


def test_clear_and_a_zero_budget() -> None:
    cache = PrefixCache(10**6)
    cache.insert(A, kv(A))
    cache.clear()
    assert (cache.match(A).length, cache.nbytes, cache.epoch) == (0, 0, 1)
    off = PrefixCache(0)
    off.insert(A, kv(A))
    assert not off.enabled and off.match(A).length == 0


def test_shared_prefixes_are_the_branch_points() -> None:
    keys = [(1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 9), (7, 8), (7, 8)]
    assert shared_prefixes(keys) == [(1, 2), (7, 8), (1, 2, 3)]
    assert shared_prefixes(keys, min_len=3) == [(1, 2, 3)]
    assert shared_prefixes([(1, 2)]) == [] and shared_prefixes([(1,), (2,)]) == []


def test_buckets_keep_padding_bounded() -> None:
    assert buckets([1, 1, 1, 100], slack=0) == [[0, 1, 2], [3]]
    assert buckets([30, 28, 31, 29]) == [[1, 3, 0, 2]]
    assert sorted(i for group in buckets([5, 400, 3, 1, 390, 2]) for i in group) == list(range(6))


def test_spare_layer_appends_like_concatenation() -> None:
    layer, generator = SpareLayer(), torch.Generator().manual_seed(0)
    want_k = want_v = torch.zeros(2, 3, 0, 4)
    for width in [5] + [1] * 70 + [9]:
        k, v = torch.randn(2, 3, width, 4, generator=generator), torch.randn(2, 3, width, 4, generator=generator)
        want_k, want_v = torch.cat([want_k, k], dim=2), torch.cat([want_v, v], dim=2)
        keys, values = layer.update(k, v)
        assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
    k = torch.ones(1, 3, 1, 4)
    keys, _ = layer.update(k, k)
    assert torch.equal(keys, torch.cat([want_k[[1]], k], dim=2))


def tagged_batch(rows: int, columns: int, pads: list[int]) -> Batch:
    """A batch of `rows` rows named 0..rows-1 whose KV holds the row's name at each column (row i left-padded by
    `pads[i]` columns, marked in the mask), grown through `SpareLayer` so it is a view of its buffer."""
    batch = Batch()
    names = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1, 1).expand(rows, HEADS, columns, DIM).clone()
    mask = torch.ones(rows, columns, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    cache = new_cache()
    for _ in range(LAYERS):
        cache.layers.append(SpareLayer())
        cache.layers[-1].update(names, names + 100)
    batch.add(list(range(rows)), cache, mask)  # type: ignore[arg-type]
    return batch


def test_fill_from_end_moves_only_the_rows_past_the_new_end() -> None:
    assert fill_from_end([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert fill_from_end([3, 4]) == [3, 4]
    assert fill_from_end([0, 1, 2]) == [0, 1, 2]


def test_batch_keep_moves_leaving_rows_places_without_copying_the_cache() -> None:
    batch = tagged_batch(6, 8, pads=[0, 1, 2, 3, 4, 5])
    assert batch.cache is not None
    before = [layer.keys.data_ptr() for layer in batch.cache.layers]
    batch.keep([0, 2, 3, 5])
    assert batch.rows == [0, 5, 2, 3]
    assert [layer.keys.data_ptr() for layer in batch.cache.layers] == before
    for layer in batch.cache.layers:
        assert layer.keys[:, 0, 0, 0].tolist() == [0, 5, 2, 3]
        assert layer.values[:, 0, -1, 0].tolist() == [100, 105, 102, 103]
    assert batch.mask is not None and batch.mask.sum(1).tolist() == [8, 3, 6, 5]
    step = torch.full((4, HEADS, 1, DIM), 7.0)
    keys, _ = batch.cache.layers[0].update(step, step)
    assert keys.shape == (4, HEADS, 9, DIM) and keys.data_ptr() == before[0] and keys[:, 0, -1, 0].tolist() == [7] * 4


def test_batch_keep_trims_columns_every_kept_row_pads() -> None:
    batch = tagged_batch(3, TRIM_COLUMNS + 4, pads=[0, TRIM_COLUMNS, TRIM_COLUMNS + 1])
    batch.keep([1, 2])
    assert batch.rows == [2, 1] and batch.mask is not None and batch.cache is not None
    assert batch.mask.shape == (2, 4) and batch.mask.sum(1).tolist() == [3, 4]
    assert batch.cache.layers[0].keys.shape == (2, HEADS, 4, DIM)
    assert batch.cache.layers[1].values[:, 0, -1, 0].tolist() == [102, 101]
    batch.keep([1])
    assert batch.rows == [1] and batch.mask.shape == (1, 4)
    assert batch.cache.layers[1].keys[0, 0, :, 0].tolist() == [1] * 4


def test_batch_add_fills_rows_that_keep_freed_without_copying_the_cache() -> None:
    batch = tagged_batch(4, 8, pads=[0, 0, 0, 0])
    batch.keep([0, 3])
    assert batch.cache is not None and batch.mask is not None
    before = [layer.keys.data_ptr() for layer in batch.cache.layers]
    joining = tagged_batch(2, 5, pads=[1, 0])
    assert joining.cache is not None and joining.mask is not None
    for layer in joining.cache.layers:
        layer.keys, layer.values = layer.keys + 10, layer.values + 10
    batch.add([10, 11], joining.cache, joining.mask)  # type: ignore[list-item]
    assert batch.rows == [0, 3, 10, 11]
    assert [layer.keys.data_ptr() for layer in batch.cache.layers] == before
    keys = batch.cache.layers[1].keys
    assert keys.shape == (4, HEADS, 8, DIM)
    assert keys[:, 0, :, 0].tolist() == [[0] * 8, [3] * 8, [0] * 3 + [10] * 5, [0] * 3 + [11] * 5]
    assert batch.mask.tolist()[2:] == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]]
    longer = tagged_batch(1, 9, pads=[0])
    assert longer.cache is not None and longer.mask is not None
    batch.add([12], longer.cache, longer.mask)  # type: ignore[list-item]
    assert batch.cache.layers[0].keys.shape == (5, HEADS, 9, DIM) and batch.mask.shape == (5, 9)
    assert batch.cache.layers[0].keys[:, 0, 0, 0].tolist() == [0, 0, 0, 0, 0]
    assert batch.cache.layers[0].keys[:, 0, -1, 0].tolist() == [0, 3, 10, 11, 0]
