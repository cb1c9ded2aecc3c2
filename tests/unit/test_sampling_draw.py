"""`engine.sampling.draw`: the inverse-CDF draw behind every sampled token of the embedded engine, its block-wise
search against one running sum over the whole row, and `sample_rows`' logprobs against `full_logprobs`."""

from __future__ import annotations

import collections

import torch

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.sampling import (
    BLOCK,
    draw,
    draw_rows,
    full_logprobs,
    make_generator,
    row_argmax,
    sample_row,
    sample_rows,
)


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


def whole_row_draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The reference inverse CDF: one float64 running sum over the whole row, the same uniform number per row."""
    cdf = probs.double().cumsum(1)
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    return torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)


def test_block_search_draws_the_token_one_running_sum_draws() -> None:
    """Seeded: the same uniform number lands on the same token as in one float64 running sum over the row, for
    vocabularies with and without a narrower last block, and rows with zero blocks."""
    for vocab in (BLOCK * 3, BLOCK * 5 + 37, 49152):
        logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
        logits[::3, BLOCK : 2 * BLOCK] = float("-inf")  # whole blocks of weight 0
        probs = torch.softmax(logits, 1)
        for seed in range(5):
            ours = draw_rows(probs, [make_generator(100 * seed + i, "cpu") for i in range(64)])
            reference = whole_row_draw(probs, [make_generator(100 * seed + i, "cpu") for i in range(64)])
            assert ours.tolist() == reference.tolist()
            assert bool((probs.gather(1, ours.unsqueeze(1)) > 0).all())


def test_block_search_follows_the_distribution_across_blocks() -> None:
    weights = torch.zeros(BLOCK * 2 + 5)
    cells = {3: 0.2, BLOCK - 1: 0.1, BLOCK: 0.3, 2 * BLOCK + 4: 0.4}  # block edges and the narrow last block
    for index, p in cells.items():
        weights[index] = p
    generator = make_generator(3, "cpu")
    picked = draw_rows(weights.expand(20_000, -1), [generator] * 20_000)
    counts = collections.Counter(picked.tolist())
    assert set(counts) == set(cells)
    for index, p in cells.items():
        assert abs(counts[index] / 20_000 - p) < 0.015, counts


def test_row_argmax_is_argmax_with_ties_and_a_narrow_last_block() -> None:
    for vocab in (7, BLOCK * 2, BLOCK * 4 + 9):
        values = torch.randint(0, 5, (32, vocab), generator=torch.Generator().manual_seed(vocab)).float()
        assert row_argmax(values).tolist() == values.argmax(1).tolist()


def test_sampled_logprobs_are_full_logprobs() -> None:
    """Every kind of row reports log_softmax(logits / T) of its token, T = 1 when greedy."""
    logits = (torch.randn(5, 3000, generator=torch.Generator().manual_seed(9)) * 6).to(torch.bfloat16)
    params = [SamplingParams(max_new_tokens=1, temperature=t, top_k=k, top_p=p)
              for t, k, p in ((0.7, -1, 1.0), (0.0, -1, 1.0), (1.0, 40, 1.0), (1.3, -1, 0.9), (1.0, -1, 1.0))]
    tokens, logprobs = sample_rows(logits, params, [make_generator(i, "cpu") for i in range(5)])
    reference = full_logprobs(logits, [p.temperature for p in params])
    expected = reference.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), expected.double(), atol=1e-6, rtol=0)
    assert tokens[1] == int(torch.argmax(logits[1].float()))
