"""Prefix trees of training rows (train/prefix_tree.py, train/tree_batch.py's mask and slots) and the tree-aware
micro-batch packing and rank split (train/batching.py, train/data_parallel.py): shapes, ancestry against a
brute-force check, grouping by cost, trees kept whole."""

from __future__ import annotations

import random

import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.batching import BatchSettings, micro_batches
from relax_pipeline.train.data_parallel import shard
from relax_pipeline.train.prefix_tree import build_tree, tree_groups
from relax_pipeline.train.tree_batch import ancestor_matrix, pack_trees


def row(tokens: tuple[int, ...], prompt: int) -> Sample:
    size = len(tokens) - prompt
    return Sample(tokens, prompt, (1,) * size, (0.0,) * size, advantage=0.0)


FORKS = [(1, 2, 3, 4, 5), (1, 2, 3, 9), (1, 2, 7), (1, 2, 3, 4, 5), (1, 2, 3), (8, 2, 3)]
"""Forks at depths 3 and 2, a duplicate, a row that is another's prefix, and a second root."""


def test_a_tree_holds_each_distinct_prefix_once_at_its_depth() -> None:
    tree = build_tree(FORKS)
    assert tree.tokens == (1, 2, 3, 4, 5, 9, 7, 8, 2, 3)
    assert tree.parents == (-1, 0, 1, 2, 3, 2, 1, -1, 7, 8)
    assert tree.depths == (0, 1, 2, 3, 4, 3, 2, 0, 1, 2)
    assert tree.paths[0] == tree.paths[3] == (0, 1, 2, 3, 4) and tree.paths[4] == (0, 1, 2)
    assert [tuple(tree.tokens[n] for n in p) for p in tree.paths] == [tuple(r) for r in FORKS]
    assert tree.runs() == [(0, 5), (5, 6), (6, 7), (7, 10)]


def test_each_node_sees_exactly_itself_and_its_ancestors() -> None:
    rng = random.Random(3)
    rows = [tuple(rng.choice((1, 2)) for _ in range(rng.randint(1, 9))) for _ in range(12)]
    tree = build_tree(rows)
    matrix = ancestor_matrix(tree)
    for node in range(tree.size):
        seen, walk = set(), node
        while walk >= 0:
            seen.add(walk)
            walk = tree.parents[walk]
        assert set(torch.nonzero(matrix[node]).flatten().tolist()) == seen


def test_rows_that_share_much_form_one_tree_and_unrelated_rows_their_own() -> None:
    rng = random.Random(0)
    trunk = tuple(rng.randrange(10, 1000) for _ in range(300))
    forks = [trunk[:cut] + tuple(rng.randrange(10, 1000) for _ in range(40)) for cut in (100, 200, 300)]
    alone = [(*trunk[:4], *(rng.randrange(10, 1000) for _ in range(300))) for _ in range(2)]
    groups = tree_groups([forks[0], alone[0], forks[1], alone[1], forks[2]])
    assert [g.rows for g in groups] == [(0, 2, 4), (1,), (3,)], "a 4-token preamble is not worth a long tree row"
    assert groups[0].tree.size == 300 + 3 * 40


def test_a_capped_tree_stays_within_its_nodes_and_keeps_each_row_whole() -> None:
    rng = random.Random(1)
    preamble = tuple(rng.randrange(10, 1000) for _ in range(10))
    groups_of_rows = [preamble + tuple(rng.randrange(10, 1000) for _ in range(8)) for _ in range(4)]
    rows = [p + tuple(rng.randrange(10, 1000) for _ in range(6)) for p in groups_of_rows for _ in range(4)]
    rows.append(tuple(rng.randrange(10, 1000) for _ in range(70)))
    assert len(tree_groups(rows[:-1])) == 1, "uncapped, every row shares the preamble: one tree"
    capped = tree_groups(rows, limit=50)
    assert sorted(i for g in capped for i in g.rows) == list(range(len(rows)))
    assert all(g.tree.size <= 50 for g in capped if len(g.rows) > 1) and capped[-1].rows == (len(rows) - 1,)
    assert [len(g.rows) for g in capped[:-1]] == [4, 4, 4, 4], "a group of 42 nodes fits, a second one does not"
    for group in capped:
        assert [tuple(group.tree.tokens[n] for n in p) for p in group.tree.paths] == [rows[i] for i in group.rows]


def test_slots_point_each_response_token_at_the_node_before_it() -> None:
    samples = [row((1, 2, 3, 4, 5), 2), row((1, 2, 3, 9), 3), row((8, 2, 3), 1)]
    groups = tree_groups([s.tokens for s in samples])
    batch = pack_trees(samples, groups, 3, 0, "cpu")
    assert batch.computed == 6 + 3 and batch.input_ids.shape == (len(groups), max(g.tree.size for g in groups))
    kept = batch.input_ids[:, batch.keep].flatten()[batch.nodes]
    predictors = kept[batch.slot]
    assert predictors.tolist() == [[2, 3, 4], [3, 2, 2], [8, 2, 2]], "padding slots point at node 0 of nodes"
    assert batch.positions[0, : groups[0].tree.size].tolist() == list(groups[0].tree.depths)


def test_tree_packing_keeps_a_tree_in_one_micro_batch() -> None:
    trunk = tuple(range(10, 110))
    forks = [row(trunk[:cut] + (5,) * 10, cut) for cut in (40, 70, 100)]
    other = [row(tuple(range(500, 560)), 30), row(tuple(range(600, 650)), 30)]
    samples = [forks[0], other[0], forks[1], other[1], forks[2]]
    chunks = micro_batches(samples, BatchSettings(micro_batch_size=3))
    assert chunks == [forks, other], "trees in the order of their first row"
    assert micro_batches(samples, BatchSettings(micro_batch_size=3, tree=False))[0] == samples[:3]
    dynamic = micro_batches(samples, BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=130))
    assert dynamic == [forks, [other[0], other[1]]], "130 tree tokens hold the 130-token tree; two rows of 60"
    cut = micro_batches(samples, BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=120))
    assert cut == [[forks[2]], forks[:2], other], "cut at 120: forks 1-2 (90 tokens), fork 3 (110), largest first"


def test_ranks_get_whole_trees_and_a_tree_too_large_for_one_rank_row_by_row() -> None:
    trunks = [tuple(range(start, start + 90)) for start in (100, 300)]
    sessions = [[row(trunk[:cut] + (5,) * 10, cut) for cut in (30, 60, 90)] for trunk in trunks]
    alone = [row(tuple(range(600 + 40 * i, 640 + 40 * i)), 20) for i in range(2)]
    samples = [sessions[0][0], sessions[1][0], alone[0], sessions[0][1], sessions[1][1], alone[1], sessions[0][2],
               sessions[1][2]]
    shares = shard(samples, 2, BatchSettings(micro_batch_size=8))
    held = [{s.tokens for b in share.micro_batches for s in b} for share in shares]
    assert held == [{s.tokens for s in sessions[0] + alone[:1]}, {s.tokens for s in sessions[1] + alone[1:]}]
    nested = [row(tuple(range(10, 10 + n)), 1) for n in (4, 6, 8, 10)]
    dealt = shard(nested, 2, BatchSettings(micro_batch_size=8))
    assert [list(s.micro_batches[0]) for s in dealt] == [nested[0::2], nested[1::2]], "one big tree: row by row"


def test_a_forked_session_longer_than_the_cap_stays_one_tree_and_a_short_groups_preamble_does_not() -> None:
    """Past its cap a tree grows only with no more attention pairs than its rows (nodes² <= sum of squared row
    lengths): a session forked at every turn (long rows sharing most tokens) stays one tree per session, each
    started by its longest leaf; short rows that share only a preamble are split by the cap."""
    rng = random.Random(2)
    system = tuple(rng.randrange(10, 1000) for _ in range(48))
    sessions = []
    for _ in range(2):
        history, rows = system + tuple(rng.randrange(10, 1000) for _ in range(8)), []
        for _ in range(8):
            rows.append(history + tuple(rng.randrange(10, 1000) for _ in range(24)))
            history += tuple(rng.randrange(10, 1000) for _ in range(48))
        sessions.append(rows)
    groups = tree_groups(sessions[0] + sessions[1], limit=256)
    assert [g.rows for g in groups] == [tuple(range(8)), tuple(range(8, 16))]
    assert [g.tree.size for g in groups] == [80 + 7 * 72] * 2 and all(g.tree.size > 256 for g in groups)
    short = [system + tuple(rng.randrange(10, 1000) for _ in range(16)) for _ in range(16)]
    assert all(g.tree.size <= 256 for g in tree_groups(short, limit=256)) and len(tree_groups(short, limit=256)) > 1
