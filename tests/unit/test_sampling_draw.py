"""`engine.sampling.draw`: the inverse-CDF draw behind every sampled token of the embedded engine."""

from __future__ import annotations

import collections

import torch

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.sampling import draw, make_generator, sample_row, sample_rows


def test_draws_follow_the_distribution_and_never_pick_a_zero() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    generator = make_generator(7, "cpu")
    counts = collections.Counter(int(draw(probs, generator)) for _ in range(20_000))
    assert set(counts) == {0, 2, 3}
    for index, p in ((0, 0.1), (2, 0.6), (3, 0.3)):
        assert abs(counts[index] / 20_000 - p) < 0.015, counts


def test_unnormalized_weights_and_a_single_survivor() -> None:
    generator = make_generator(1, "cpu")
    assert {int(draw(torch.tensor([2.0, 6.0]), generator)) for _ in range(200)} == {0, 1}
    assert {int(draw(torch.tensor([0.0, 0.0, 3.0, 0.0]), generator)) for _ in range(50)} == {2}


def test_the_same_seed_draws_the_same_tokens() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9)] * 4

    def tokens(seed: int) -> list[int]:
        return sample_rows(logits, params, [make_generator(seed + i, "cpu") for i in range(4)])[0]

    assert tokens(3) == tokens(3) and tokens(3) != tokens(4)


def test_top_k_one_is_the_argmax() -> None:
    logprobs = torch.log_softmax(torch.randn(500, generator=torch.Generator().manual_seed(2)), dim=0)
    picked = sample_row(logprobs, SamplingParams(max_new_tokens=1, temperature=1.0, top_k=1), make_generator(0, "cpu"))
    assert int(picked) == int(torch.argmax(logprobs))


def test_rows_drawn_together_match_rows_drawn_alone() -> None:
    """A row's token and logprob depend only on its logits and its own generator, not on the batch around it."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 4
    plain = SamplingParams(max_new_tokens=1, temperature=0.7)
    params = [plain, SamplingParams(max_new_tokens=1, temperature=0.0), plain,
              SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.8), plain, plain]
    together = sample_rows(logits, params, [make_generator(10 + i, "cpu") for i in range(6)])
    alone = [sample_rows(logits[i : i + 1], [params[i]], [make_generator(10 + i, "cpu")]) for i in range(6)]
    assert together[0] == [a[0][0] for a in alone]
    assert together[1] == [a[1][0] for a in alone]
    assert together[0][1] == int(torch.argmax(logits[1]))
