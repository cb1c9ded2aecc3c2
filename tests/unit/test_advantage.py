"""Advantage estimators: base scalars per group, token expansion (incl. reinforce++ KL shaping), whitening.

Every expected number is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch

from relax_pipeline.credit.advantage import base_advantages
from relax_pipeline.credit.settings import ESTIMATORS
from relax_pipeline.train.advantages import token_advantages, whiten


def test_estimator_names() -> None:
    assert ESTIMATORS == ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def test_grpo_divides_by_unbiased_std() -> None:
    # mean 2; centred [-2, 0, 2]; unbiased var (4 + 0 + 4) / 2 = 4; std 2 -> [-1, 0, 1]
    assert base_advantages([0.0, 2.0, 4.0], "grpo", eps=0.0) == [-1.0, 0.0, 1.0]
    # with the default eps 1e-6: 2 / (2 + 1e-6)
    assert base_advantages([0.0, 2.0, 4.0], "grpo") == pytest.approx([-2 / 2.000001, 0.0, 2 / 2.000001], rel=1e-12)


def test_grpo_without_std_only_centres() -> None:
    # mean 2 -> [-2, 0, 2]
    assert base_advantages([0.0, 2.0, 4.0], "grpo", normalize_std=False) == [-2.0, 0.0, 2.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_of_one_and_equal_rewards_give_zeros(estimator: str) -> None:
    # one reward: nothing left after centring (rloo: n=1 -> 0); equal rewards: r - mean = 0, 0 / (0 + eps) = 0
    assert base_advantages([0.7], estimator) == [0.0]
    assert base_advantages([3.0, 3.0, 3.0], estimator) == [0.0, 0.0, 0.0]


def test_rloo_subtracts_mean_of_the_others() -> None:
    # 0 - (2 + 4) / 2 = -3; 2 - (0 + 4) / 2 = 0; 4 - (0 + 2) / 2 = 3
    assert base_advantages([0.0, 2.0, 4.0], "rloo") == [-3.0, 0.0, 3.0]


def test_reinforce_plus_plus_keeps_the_reward() -> None:
    # no group baseline, no std: the reward itself, even for a group of one
    assert base_advantages([0.0, 2.0, 4.0], "reinforce_plus_plus") == [0.0, 2.0, 4.0]
    assert base_advantages([5.0], "reinforce_plus_plus") == [5.0]


def test_reinforce_plus_plus_baseline_centres_without_std() -> None:
    # mean 2 -> [-2, 0, 2]; normalize_std does not apply
    assert base_advantages([0.0, 2.0, 4.0], "reinforce_plus_plus_baseline", normalize_std=True) == [-2.0, 0.0, 2.0]


def test_empty_group_gives_empty_list() -> None:
    assert base_advantages([], "grpo") == []


def test_unknown_estimator_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"credit\.estimator.*'ppo'.*grpo.*rloo"):
        base_advantages([1.0], "ppo")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_rejected(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        base_advantages([1.0, bad], "grpo")


# Two rows, T=6. Row 0 is multi-turn: loss-1 span [0, 1], observation tokens 2-3 (loss 0), span [4],
# padding at 5. Row 1: one span [0, 2], padding 3-5.
MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_broadcast_base_onto_mask_one_tokens(estimator: str) -> None:
    out = token_advantages(torch.tensor([0.5, -1.0]), MASK, estimator)
    expected = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.5, 0.0], [-1.0, -1.0, -1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_refuse_kl_shaping(estimator: str) -> None:
    with pytest.raises(ValueError, match=r"credit\.kl_coef.*trainer\.loss\.use_kl_loss"):
        token_advantages(torch.tensor([0.5, -1.0]), MASK, estimator, kl=torch.zeros(2, 6), kl_coef=0.1)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_kl_shaping_returns_to_go(estimator: str) -> None:
    # 9.0 sits on observation/padding tokens: it must never leak into rewards
    kl = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0], [0.5, 0.0, 0.1, 9.0, 9.0, 9.0]])
    out = token_advantages(torch.tensor([1.0, 2.0]), MASK, estimator, kl=kl, kl_coef=0.5)
    # row 0 rewards: t0 -0.5*0.1 = -0.05; t1 -0.5*0.2 = -0.1; t4 -0.5*0.4 + 1.0 (base at last mask-1) = 0.8
    #   returns-to-go over mask-1 tokens: t4 0.8; t1 -0.1 + 0.8 = 0.7; t0 -0.05 + 0.7 = 0.65; t2, t3, t5 -> 0
    # row 1 rewards: t0 -0.25; t1 0; t2 -0.05 + 2.0 = 1.95 -> returns: t2 1.95; t1 1.95; t0 1.70
    expected = torch.tensor([[0.65, 0.7, 0.0, 0.0, 0.8, 0.0], [1.7, 1.95, 1.95, 0.0, 0.0, 0.0]])
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(out[MASK == 0], torch.zeros(int((MASK == 0).sum())))


def test_reinforce_plus_plus_without_kl_puts_base_on_every_mask_one_token() -> None:
    # reward only at the last mask-1 token, gamma=1 -> every earlier mask-1 token sees it too
    out = token_advantages(torch.tensor([3.0, -1.0]), MASK, "reinforce_plus_plus")
    expected = torch.tensor([[3.0, 3.0, 0.0, 0.0, 3.0, 0.0], [-1.0, -1.0, -1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(out, expected)


def test_row_without_mask_one_tokens_gets_zeros() -> None:
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    out = token_advantages(torch.tensor([5.0, 2.0]), mask, "reinforce_plus_plus", kl=torch.ones(2, 2), kl_coef=1.0)
    # row 0: no tokens -> nothing; row 1: t0 reward -1*1 + 2 = 1
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))


def test_kl_shaping_needs_kl() -> None:
    with pytest.raises(ValueError, match=r"credit\.kl_coef.*kl=None"):
        token_advantages(torch.tensor([1.0, 2.0]), MASK, "reinforce_plus_plus", kl_coef=0.1)


def test_token_advantages_checks_shapes() -> None:
    with pytest.raises(ValueError, match=r"base must be \[B\]"):
        token_advantages(torch.tensor([1.0]), MASK, "grpo")


def test_whiten_uses_mask_one_tokens_of_the_whole_batch() -> None:
    advantages = torch.tensor([[1.0, 3.0, 99.0], [5.0, -42.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    out = whiten(advantages, mask, eps=0.0)
    # mask-1 values [1, 3, 5, 7]: mean 4, centred [-3, -1, 1, 3], unbiased var (9+1+1+9)/3 = 20/3
    std = math.sqrt(20 / 3)  # 2.5819889
    expected = torch.tensor([[-3 / std, -1 / std, 0.0], [1 / std, 0.0, 3 / std]])
    assert torch.allclose(out, expected, atol=1e-6)
    assert out[0, 2].item() == 0.0 and out[1, 1].item() == 0.0


def test_whiten_with_fewer_than_two_tokens_is_zero() -> None:
    # one mask-1 token: a - mean = 0
    out = whiten(torch.tensor([[4.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(out, torch.zeros(1, 2))
