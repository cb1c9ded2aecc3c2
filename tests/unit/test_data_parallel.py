"""The data-parallel split rule and cross-rank reductions (train/data_parallel.py), without processes.

Several ranks are simulated with threads sharing an all-reduce (`ThreadAllSum`), so `whiten_across` and
`sum_metrics` are checked against the one-process results on the same global batch.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.advantages import whiten
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.data_parallel import padding_sample, shard, sum_metrics, whiten_across


def sample(prompt: int, mask: tuple[int, ...], advantage: float = 0.5) -> Sample:
    tokens = tuple(range(10, 10 + prompt + len(mask)))
    return Sample(tokens, prompt, mask, tuple(-1.0 if m else 0.0 for m in mask), advantage=advantage)


def batch(count: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [sample(rng.randint(1, 9), tuple(rng.choice((0, 1, 1)) for _ in range(rng.randint(1, 8))), rng.random())
            for _ in range(count)]


class ThreadAllSum:
    """An all-reduce SUM between `world` threads: each call blocks until every thread contributed."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.lock = threading.Lock()
        self.parts: list[torch.Tensor] = []
        self.result = torch.zeros(0)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.parts.append(values.clone())
        if self.barrier.wait() == 0:
            self.result = torch.stack(self.parts).sum(0)
            self.parts = []
        self.barrier.wait()
        return self.result.clone()


def test_samples_go_round_robin_and_every_rank_runs_the_same_number_of_micro_batches() -> None:
    samples = batch(7)
    shares = shard(samples, 3, BatchSettings(micro_batch_size=2))
    assert {len(share.micro_batches) for share in shares} == {2}
    assert [share.padding for share in shares] == [0, 1, 1]
    real = [[s for mb in share.micro_batches[: 2 - share.padding] for s in mb] for share in shares]
    assert real == [samples[0::3], samples[1::3], samples[2::3]]
    assert all(share.micro_batches[1] == (padding_sample(samples),) for share in shares[1:])
    tokens = sum(sum(s.loss_mask) for s in samples)
    assert all(share.tokens == tokens and share.sequences == 7 for share in shares)


def test_one_rank_share_is_the_ordinary_packing() -> None:
    samples = batch(5)
    (share,) = shard(samples, 1, BatchSettings(micro_batch_size=2))
    assert share.micro_batches == (tuple(samples[0:2]), tuple(samples[2:4]), tuple(samples[4:5]))
    assert share.padding == 0


def test_more_ranks_than_samples_gives_padding_only_shares() -> None:
    samples = batch(2)
    shares = shard(samples, 4, BatchSettings(micro_batch_size=8))
    assert [len(s.micro_batches) for s in shares] == [1, 1, 1, 1]
    assert [s.padding for s in shares] == [0, 0, 1, 1]
    pad = shares[3].micro_batches[0][0]
    assert pad == padding_sample(samples) and not any(pad.loss_mask) and pad.advantage == 0.0
    assert len(pad.tokens) == min(len(s.tokens) for s in samples)


def test_split_mistakes_name_the_key() -> None:
    with pytest.raises(ValueError, match="trainer.num_ranks=0"):
        shard(batch(2), 0, BatchSettings())


def run_ranks(world: int, work: object) -> list:
    all_sum = ThreadAllSum(world)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda rank: work(rank, all_sum), range(world)))  # type: ignore[operator]


def test_whitening_across_ranks_equals_whitening_the_whole_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    advantages = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    parts = run_ranks(3, lambda rank, s: whiten_across(advantages[rank::3], mask[rank::3], s))
    whole = whiten(advantages, mask)
    for rank, part in enumerate(parts):
        torch.testing.assert_close(part, whole[rank::3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whiten_across(advantages, mask, lambda t: t), whole, rtol=1e-5, atol=1e-6)


def test_fewer_than_two_tokens_over_all_ranks_whiten_to_zero() -> None:
    mask = torch.tensor([[1.0, 0.0]])
    parts = run_ranks(2, lambda rank, s: whiten_across(torch.ones(1, 2), mask if rank == 0 else mask * 0, s))
    assert all(not p.any() for p in parts)


def test_metrics_are_summed_over_ranks_whatever_their_key_order() -> None:
    mine = [{"loss": 0.25, "clipfrac": 0.5}, {"clipfrac": 0.25, "loss": -0.5}]
    summed = run_ranks(2, lambda rank, s: sum_metrics(mine[rank], s))
    assert summed == [{"clipfrac": 0.75, "loss": -0.25}] * 2
