"""The GRPO-family policy loss: clipping, TIS, OPSM, entropy, reference KL, reductions, micro-batching.

Every expected number is worked out by hand in the comment next to it; the micro-batch test compares
the function with itself (one batch vs two micro-batches), which is the property it checks.
"""

from __future__ import annotations

import math

import pytest
import torch

from relax_pipeline.train.losses import (
    KL_ESTIMATORS,
    REDUCTIONS,
    LossBatch,
    LossSettings,
    kl_estimate,
    policy_loss,
    reduce,
)

LN = math.log


def make_batch(logprobs: list[list[float]], advantages: list[list[float]], mask: list[list[float]] | None = None,
               old: list[list[float]] | None = None, rollout: list[list[float]] | None = None,
               **extra: object) -> LossBatch:
    """A LossBatch with `logprobs` as a grad leaf; old/rollout default to the logprobs' values (ratio 1)."""
    lp = torch.tensor(logprobs, requires_grad=True)
    mask_t = torch.ones_like(lp) if mask is None else torch.tensor(mask)
    old_t = lp.detach().clone() if old is None else torch.tensor(old)
    rollout_t = old_t.clone() if rollout is None else torch.tensor(rollout)
    fields: dict[str, object] = {"token_normalizer": float(mask_t.sum()), "seq_normalizer": float(lp.shape[0])}
    fields.update(extra)
    return LossBatch(logprobs=lp, old_logprobs=old_t, rollout_logprobs=rollout_t,
                     advantages=torch.tensor(advantages), loss_mask=mask_t, **fields)  # type: ignore[arg-type]


def test_names() -> None:
    assert REDUCTIONS == ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
    assert KL_ESTIMATORS == ("k1", "k2", "k3")


def test_ratio_and_asymmetric_clipping() -> None:
    # old = -1 everywhere; ratios r = [1.5, 0.5, 1.5, 0.5, 1.25]; A = [+1, +1, -1, -1, +1]; eps 0.2 / 0.28
    ratios = [1.5, 0.5, 1.5, 0.5, 1.25]
    batch = make_batch([[-1.0 + LN(r) for r in ratios]], [[1.0, 1.0, -1.0, -1.0, 1.0]], old=[[-1.0] * 5])
    loss, metrics = policy_loss(batch, LossSettings(eps_clip_low=0.2, eps_clip_high=0.28))
    # t0 A=+1 r=1.5 : max(-1.5, -1.28) = -1.28  clipped at 1+0.28, no gradient
    # t1 A=+1 r=0.5 : max(-0.5, -0.8)  = -0.5   unclipped (a positive A is not clipped below), d/dlogp = -0.5
    # t2 A=-1 r=1.5 : max(1.5, 1.28)   = 1.5    unclipped (a negative A is not clipped above), d/dlogp = 1.5
    # t3 A=-1 r=0.5 : max(0.5, 0.8)    = 0.8    clipped at 1-0.2, no gradient
    # t4 A=+1 r=1.25: max(-1.25, -1.25)= -1.25  inside 1+0.28 (a symmetric 0.2 would clip), d/dlogp = -1.25
    # token_mean: (-1.28 - 0.5 + 1.5 + 0.8 - 1.25) / 5 = -0.73 / 5 = -0.146
    assert loss.item() == pytest.approx(-0.146, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(-0.146, abs=1e-6)
    assert metrics["clipfrac"] == pytest.approx(2 / 5)  # t0, t3
    # ppo_kl = mean(old - new) = -(2 ln 0.75 + ln 1.25) / 5 = -(-0.5753641 + 0.2231436) / 5 = 0.0704441
    assert metrics["ppo_kl"] == pytest.approx(0.0704441, abs=1e-6)
    loss.backward()
    # d(-A r)/dlogp = -A r, divided by the token normalizer 5
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[0.0, -0.1, 0.3, 0.0, -0.25]]), atol=1e-6)


def test_tis_weights_are_capped_and_detached() -> None:
    # ratio 1 (logprobs == old = -1), A = +1 -> pg = -1 per token, d pg / d logp = -1
    # old - rollout = [ln 2, ln 0.5, ln 4] -> w = min([2, 0.5, 4], 3) = [2, 0.5, 3]
    old = torch.full((1, 3), -1.0, requires_grad=True)
    rollout = torch.tensor([[-1.0 - LN(2.0), -1.0 - LN(0.5), -1.0 - LN(4.0)]], requires_grad=True)
    logprobs = torch.full((1, 3), -1.0, requires_grad=True)
    batch = LossBatch(logprobs=logprobs, old_logprobs=old, rollout_logprobs=rollout,
                      advantages=torch.ones(1, 3), loss_mask=torch.ones(1, 3), token_normalizer=3.0, seq_normalizer=1.0)
    loss, metrics = policy_loss(batch, LossSettings(tis_cap=3.0))
    # (-2 - 0.5 - 3) / 3 = -1.8333333
    assert loss.item() == pytest.approx(-5.5 / 3, abs=1e-6)
    assert metrics["tis_clipfrac"] == pytest.approx(1 / 3)  # only the weight 4 hit the cap
    loss.backward()
    # gradient is w * (-1) / 3 = [-2/3, -1/6, -1]; the weight itself carries no gradient
    assert torch.allclose(logprobs.grad, torch.tensor([[-2 / 3, -1 / 6, -1.0]]), atol=1e-6)
    assert old.grad is None and rollout.grad is None


def test_opsm_masks_only_negative_advantage_high_kl_sequences() -> None:
    # logprobs == old = -1 (ratio 1, pg = -A); delta 0.1; rollout - current per row:
    # row 0: A=-1, [0.3, 0.1] mean 0.2 > 0.1 and A<0 -> masked
    # row 1: A=-2, [0.05, 0.05] mean 0.05 <= 0.1  -> kept
    # row 2: A=+1, [0.3, 0.3] mean 0.3 > 0.1 but A>0 -> kept
    batch = make_batch([[-1.0, -1.0]] * 3, [[-1.0, -1.0], [-2.0, -2.0], [1.0, 1.0]],
                       rollout=[[-0.7, -0.9], [-0.95, -0.95], [-0.7, -0.7]])
    loss, metrics = policy_loss(batch, LossSettings(opsm_delta=0.1))
    # pg: row 0 -> 0, 0; row 1 -> 2, 2; row 2 -> -1, -1; token_mean (0 + 4 - 2) / 6 = 1/3
    assert loss.item() == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["opsm_masked"] == pytest.approx(1 / 3)  # 1 of 3 sequences
    loss.backward()
    # masked row has exactly zero gradient; row 1: -A/6 = 2/6; row 2: -1/6
    assert torch.equal(batch.logprobs.grad[0], torch.zeros(2))
    assert torch.allclose(batch.logprobs.grad[1:], torch.tensor([[1 / 3, 1 / 3], [-1 / 6, -1 / 6]]), atol=1e-6)


def test_opsm_off_keeps_every_sequence() -> None:
    batch = make_batch([[-1.0, -1.0]], [[-1.0, -1.0]], rollout=[[0.0, 0.0]])
    loss, metrics = policy_loss(batch, LossSettings())
    # pg = -A = 1 per token, (1 + 1) / 2 = 1
    assert loss.item() == pytest.approx(1.0)
    assert "opsm_masked" not in metrics and "tis_clipfrac" not in metrics


def test_entropy_bonus_lowers_the_loss() -> None:
    entropy = torch.tensor([[1.0, 3.0]], requires_grad=True)
    batch = make_batch([[-1.0, -1.0]], [[0.0, 0.0]], entropy=entropy)
    loss, metrics = policy_loss(batch, LossSettings(entropy_coef=0.1))
    # pg 0; entropy token_mean (1 + 3) / 2 = 2; loss = 0 - 0.1 * 2 = -0.2
    assert loss.item() == pytest.approx(-0.2)
    assert metrics["entropy"] == pytest.approx(2.0)
    loss.backward()
    # d loss / d entropy = -0.1 / 2 = -0.05: descending the loss raises the entropy
    assert torch.allclose(entropy.grad, torch.tensor([[-0.05, -0.05]]))


def test_entropy_coef_needs_entropy() -> None:
    with pytest.raises(ValueError, match=r"trainer\.loss\.entropy_coef"):
        policy_loss(make_batch([[-1.0]], [[1.0]]), LossSettings(entropy_coef=0.1))


def test_kl_estimators() -> None:
    # d = logp - logref = [0.5, -1.0]
    logp, ref = torch.tensor([-0.5, -2.0]), torch.tensor([-1.0, -1.0])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    # 0.5 * d^2 = [0.125, 0.5]
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    # exp(-d) + d - 1: exp(-0.5) - 0.5 = 0.6065307 - 0.5 = 0.1065307; exp(1) - 2 = 0.7182818
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.tensor([0.1065307, 0.7182818]), atol=1e-6)


def test_reference_kl_loss_is_added() -> None:
    batch = make_batch([[-0.5, -2.0]], [[0.0, 0.0]], ref_logprobs=torch.tensor([[-1.0, -1.0]]))
    loss, metrics = policy_loss(batch, LossSettings(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3"))
    # k3 token_mean (0.1065307 + 0.7182818) / 2 = 0.4124062; loss = 0 + 0.5 * 0.4124062 = 0.2062031
    assert metrics["kl"] == pytest.approx(0.4124062, abs=1e-6)
    assert loss.item() == pytest.approx(0.2062031, abs=1e-6)


def test_kl_loss_needs_reference_logprobs() -> None:
    with pytest.raises(ValueError, match=r"trainer\.loss\.use_kl_loss.*ref_logprobs"):
        policy_loss(make_batch([[-1.0]], [[1.0]]), LossSettings(use_kl_loss=True, kl_loss_coef=0.1))


# Rows of lengths 3, 2 and 0; 100.0 sits on padding and must be ignored.
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0], [100.0, 100.0, 100.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_reduce_token_mean() -> None:
    # (1 + 2 + 3 + 4 + 5) / 5 tokens = 3
    assert reduce(VALUES[:2], MASK[:2], "token_mean", 5.0, 2.0).item() == pytest.approx(3.0)


def test_reduce_seq_mean_token_sum() -> None:
    # row sums 6 and 9; (6 + 9) / 2 sequences = 7.5
    assert reduce(VALUES[:2], MASK[:2], "seq_mean_token_sum", 5.0, 2.0).item() == pytest.approx(7.5)


def test_reduce_seq_mean_token_mean() -> None:
    # row means 6/3 = 2 and 9/2 = 4.5; (2 + 4.5) / 2 = 3.25
    assert reduce(VALUES[:2], MASK[:2], "seq_mean_token_mean", 5.0, 2.0).item() == pytest.approx(3.25)
    # an empty row contributes 0 but counts as a sequence: (2 + 4.5 + 0) / 3 = 2.1666667
    assert reduce(VALUES, MASK, "seq_mean_token_mean", 5.0, 3.0).item() == pytest.approx(6.5 / 3)


def _accumulation_batch(rows: slice, width: int, tensors: dict[str, torch.Tensor], leaf: torch.Tensor) -> LossBatch:
    """Rows of the shared tensors, trimmed to `width` (the micro-batch's longest response)."""
    pick = {name: t[rows, :width] for name, t in tensors.items()}
    return LossBatch(logprobs=leaf[rows, :width], old_logprobs=pick["old"], rollout_logprobs=pick["rollout"],
                     advantages=pick["adv"], loss_mask=pick["mask"], entropy=pick["entropy"],
                     ref_logprobs=pick["ref"], token_normalizer=7.0, seq_normalizer=3.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_micro_batches_sum_to_the_global_batch(reduction: str) -> None:
    # 3 rows of response lengths 4, 1, 2 (7 tokens): micro-batch A = row 0 (T=4), B = rows 1-2 (T=2)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    tensors = {"mask": mask, "adv": torch.tensor([[0.5] * 4, [-1.0] * 4, [-0.3] * 4]) * mask}
    for name in ("old", "rollout", "ref"):
        tensors[name] = -torch.rand(3, 4, generator=gen) * mask
    tensors["entropy"] = torch.rand(3, 4, generator=gen)
    logprobs = (-torch.rand(3, 4, generator=gen)).requires_grad_(True)
    settings = LossSettings(tis_cap=1.1, opsm_delta=0.0, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                            loss_reduction=reduction)
    full, full_metrics = policy_loss(_accumulation_batch(slice(0, 3), 4, tensors, logprobs), settings)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    part_a, metrics_a = policy_loss(_accumulation_batch(slice(0, 1), 4, tensors, logprobs), settings)
    part_b, metrics_b = policy_loss(_accumulation_batch(slice(1, 3), 2, tensors, logprobs), settings)
    (split_grad,) = torch.autograd.grad(part_a + part_b, logprobs)
    # every correction is active in this batch, so the check covers all of them
    assert full_metrics["clipfrac"] > 0 and full_metrics["tis_clipfrac"] > 0 and full_metrics["opsm_masked"] > 0
    assert (part_a + part_b).item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(split_grad, full_grad, atol=1e-7)
    for name, value in full_metrics.items():
        assert metrics_a[name] + metrics_b[name] == pytest.approx(value, abs=1e-6), name


def test_mask_zero_tokens_never_reach_loss_or_gradient() -> None:
    # token 1 is an observation, token 3 padding; garbage there (inf, nan, huge) must change nothing
    mask = [[1.0, 0.0, 1.0, 0.0]]
    clean = make_batch([[-1.0, -1.0, -1.0, -1.0]], [[1.0, 0.0, 1.0, 0.0]], mask=mask, old=[[-1.0] * 4],
                       ref_logprobs=torch.full((1, 4), -1.0), entropy=torch.ones(1, 4))
    nan, inf = math.nan, math.inf
    dirty = make_batch([[-1.0, 50.0, -1.0, nan]], [[1.0, 1e9, 1.0, nan]], mask=mask, old=[[-1.0, -inf, -1.0, inf]],
                       rollout=[[-1.0, inf, -1.0, nan]], ref_logprobs=torch.tensor([[-1.0, nan, -1.0, -inf]]),
                       entropy=torch.tensor([[1.0, nan, 1.0, inf]]))
    settings = LossSettings(tis_cap=2.0, opsm_delta=0.5, entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=1.0)
    clean_loss, _ = policy_loss(clean, settings)
    dirty_loss, _ = policy_loss(dirty, settings)
    # valid tokens: ratio 1, A=1 -> pg -1 each; entropy 1; k3 at d=0 is 0 -> loss = -1 - 0.1 * 1 + 0 = -1.1
    assert clean_loss.item() == pytest.approx(-1.1) and dirty_loss.item() == pytest.approx(-1.1)
    dirty_loss.backward()
    grad = dirty.logprobs.grad
    assert grad[0, 1].item() == 0.0 and grad[0, 3].item() == 0.0
    # valid tokens: d(-A r)/dlogp / 2 tokens = -0.5; k3 gradient at d=0 is 0
    assert torch.allclose(grad[0, [0, 2]], torch.tensor([-0.5, -0.5]))


@pytest.mark.parametrize(("field", "value"), [
    ("loss_reduction", "sum"), ("kl_loss_type", "k4"), ("eps_clip_low", 1.0), ("eps_clip_low", -0.1),
    ("eps_clip_high", -0.1), ("tis_cap", 0.0), ("opsm_delta", -1.0), ("entropy_coef", -0.1),
    ("kl_loss_coef", math.nan),
])
def test_settings_validation_names_the_key(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"trainer\.loss\.{field}"):
        LossSettings(**{field: value})  # type: ignore[arg-type]


def test_choice_errors_list_allowed_values() -> None:
    with pytest.raises(ValueError, match="token_mean.*seq_mean_token_sum.*seq_mean_token_mean"):
        LossSettings(loss_reduction="sum")
    with pytest.raises(ValueError, match=r"trainer\.loss\.kl_loss_type.*k1.*k2.*k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "mse")
    with pytest.raises(ValueError, match=r"trainer\.loss\.loss_reduction"):
        reduce(torch.zeros(1, 1), torch.ones(1, 1), "mean", 1.0, 1.0)


def test_loss_batch_checks_shapes_and_normalizers() -> None:
    with pytest.raises(ValueError, match=r"LossBatch\.advantages"):
        LossBatch(logprobs=torch.zeros(1, 2), old_logprobs=torch.zeros(1, 2), rollout_logprobs=torch.zeros(1, 2),
                  advantages=torch.zeros(1, 3), loss_mask=torch.ones(1, 2), token_normalizer=2.0, seq_normalizer=1.0)
    with pytest.raises(ValueError, match=r"LossBatch\.token_normalizer"):
        make_batch([[-1.0]], [[1.0]], token_normalizer=0.0)
