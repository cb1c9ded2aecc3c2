"""Tree training (`trainer.batching.tree`) equals the per-row path on the tiny model, in float32.

The rows of a micro-batch packed as prefix trees (train/tree_batch.py) compute every shared token once; what
comes out must be what the padded rows give: the same logprobs and entropies per response token, the same loss
and metrics, the same gradients, on both backends (DeepSpeed ZeRO 0 and 3 on gloo). The two paths multiply and
sum in different orders (one packed row of the tree against one padded row per sample), so the comparisons are
within float32 rounding, not bit for bit: logprobs within 1e-6 (absolute), entropies and losses within 1e-5
(they sum over the vocabulary or the batch), gradients within 1e-6 absolute + 1e-5 relative; also with trees
capped at a row size (`prefix_tree.TREE_ROW_NODES`), which splits a tree into several packed rows.

Workloads: forks at different depths (inside the prompt, at the prompt's end, inside a multi-turn response,
a duplicate row, a row that is another's prefix); a session that forks at every turn (history rewritten) and
exports two contexts (a sub-agent with its own system prompt); a mixed group where some rows share nothing.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_trainer import record_gradients

from relax_pipeline.credit.settings import AdvantageSettings
from relax_pipeline.forest.sample import Sample
from relax_pipeline.train import tree_batch
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.optim import OptimSettings
from relax_pipeline.train.prefix_tree import tree_groups
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun, TrainerSettings
from relax_pipeline.train.step import collate, response_logprobs
from relax_pipeline.train.torch_backend import TorchTrainer

LOGPROB_ATOL, SUM_ATOL, GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5, 1e-6, 1e-5


def tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, 1000) for _ in range(count))


def make_row(rng: random.Random, ids: tuple[int, ...], prompt: int, observations: bool = True) -> Sample:
    """A row whose response alternates generated spans with observation spans (mask 0, logprob 0.0)."""
    size = len(ids) - prompt
    mask = tuple(0 if observations and (j // 5) % 2 else 1 for j in range(size))
    logprobs = tuple(-rng.uniform(2.0, 9.0) if m else 0.0 for m in mask)
    return Sample(ids, prompt, mask, logprobs, advantage=rng.uniform(-1.0, 1.0))


def forks_at_depths(seed: int = 0) -> list[Sample]:
    """One trunk, rows forking inside the prompt, at its end, inside the response; a duplicate; a prefix row."""
    rng = random.Random(seed)
    trunk = tokens(rng, 60)
    rows = [make_row(rng, trunk, 20)]
    for cut, prompt in ((8, 20), (19, 20), (20, 20), (33, 20), (47, 30)):
        rows.append(make_row(rng, trunk[:cut] + tokens(rng, max(0, prompt - cut) + rng.randint(6, 18)), prompt))
    rows.append(make_row(rng, trunk, 20))
    rows.append(make_row(rng, trunk[:41], 25))
    return rows


def forked_session(rng: random.Random, system: tuple[int, ...], turns: int = 4) -> list[Sample]:
    """A session whose harness rewrites every assistant turn in the history: one leaf per turn, each forking
    from the rewritten history (the generated turn is trained; the rewritten one is prompt)."""
    history, rows = system + tokens(rng, 12), []
    for _ in range(turns):
        generated, rewritten, observation = tokens(rng, 9), tokens(rng, 4), tokens(rng, 7)
        rows.append(make_row(rng, history + generated, len(history), observations=False))
        history = history + rewritten + observation
    return rows


def multi_context_session(seed: int = 1) -> list[Sample]:
    """One session exporting two contexts: the main agent's forked turns and a sub-agent's, each from its own
    system prompt, interleaved as a session's export may list them."""
    rng = random.Random(seed)
    main, sub = forked_session(rng, tokens(rng, 30)), forked_session(rng, tokens(rng, 22), turns=3)
    return [main[0], sub[0], main[1], main[2], sub[1], main[3], sub[2]]


def mixed_group(seed: int = 2) -> list[Sample]:
    """A GRPO group sharing its prompt, forked sessions, and rows that share nothing with anything."""
    rng = random.Random(seed)
    prompt = tokens(rng, 25)
    group = [make_row(rng, prompt + tokens(rng, rng.randint(5, 20)), 25) for _ in range(3)]
    alone = [make_row(rng, tokens(rng, rng.randint(15, 40)), 10) for _ in range(3)]
    return [group[0], alone[0], *forked_session(rng, prompt, turns=3), group[1], alone[1], group[2], alone[2]]


WORKLOADS = {"forks_at_depths": forks_at_depths, "multi_context": multi_context_session, "mixed_group": mixed_group}


def trainer(path: Path, tree: bool, **settings: object) -> TorchTrainer:
    batching = BatchSettings(micro_batch_size=64, tree=tree)
    run = TrainerRun(str(path), advantages=AdvantageSettings(normalize_advantages=True))
    return TorchTrainer(TrainerSettings(batching=batching, **settings), run)  # type: ignore[arg-type]


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("attention", [None, "eager", "grouped"])
def test_tree_logprobs_entropies_and_gradients_equal_the_rows(tiny_path: Path, workload: str,
                                                               attention: str | None) -> None:
    samples = WORKLOADS[workload]()
    t = trainer(tiny_path, tree=True, attn_implementation=attention)
    assert_tree_equals_rows(t, samples)


@pytest.mark.parametrize("workload", ["forks_at_depths", "mixed_group"])
def test_trees_capped_at_a_row_size_still_equal_the_rows(tiny_path: Path, workload: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    samples = WORKLOADS[workload]()
    monkeypatch.setattr("relax_pipeline.train.step.TREE_ROW_NODES", 40)
    t = trainer(tiny_path, tree=True, attn_implementation="grouped")
    packed = assert_tree_equals_rows(t, samples)
    rows = [s.tokens for s in samples]
    capped = tree_groups(rows, 40)
    assert len(packed.input_ids) == len(capped) > len(tree_groups(rows)), "the cap split a tree"
    for group in capped:  # past the cap only with no more attention pairs than its rows have as rows
        assert group.tree.size <= 40 or group.tree.size ** 2 <= sum(len(rows[i]) ** 2 for i in group.rows)


def assert_tree_equals_rows(t: TorchTrainer, samples: list[Sample]) -> tree_batch.TreeBatch:
    """Logprobs, entropies and gradients through the packed trees equal the rows'; the packed trees."""
    rows, tree = collate(samples, t.pad_id, "cpu"), collate(samples, t.pad_id, "cpu", "always")
    assert tree.tree is not None and tree.tree.computed < sum(len(s.tokens) for s in samples)
    results = []
    for batch in (rows, tree):
        t.policy.zero_grad()
        logprobs, entropy = response_logprobs(t.model, batch, 0.7, "train")
        assert entropy is not None
        objective = (logprobs * batch.base[:, None] + 0.1 * entropy) * batch.loss_mask
        (objective.sum() / batch.loss_mask.sum()).backward()  # token-mean, as the loss normalizes
        grads = {n: p.grad.clone() for n, p in t.policy.named_parameters()}
        results.append((logprobs.detach() * batch.loss_mask, entropy.detach() * batch.loss_mask, grads))
    (logprobs, entropy, grads), (tree_logprobs, tree_entropy, tree_grads) = results
    torch.testing.assert_close(tree_logprobs, logprobs, atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(tree_entropy, entropy, atol=SUM_ATOL, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(tree_grads[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)
    return tree.tree


def count_tree_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per forward through packed trees."""
    calls: list[int] = []
    original = tree_batch.tree_logits

    def counted(model: object, batch: tree_batch.TreeBatch) -> torch.Tensor:
        calls.append(batch.computed)
        return original(model, batch)  # type: ignore[arg-type]

    monkeypatch.setattr("relax_pipeline.train.step.tree_logits", counted)
    return calls


RICH_LOSS = {"loss_reduction": None, "use_rollout_logprobs": False, "entropy_coef": 0.01, "use_kl_loss": True,
             "kl_loss_coef": 0.1, "tis_cap": 2.0}
"""Recomputed old logprobs (through the tree too), an entropy bonus, a reference KL, TIS; whitened advantages."""


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_a_tree_step_has_the_rows_loss_metrics_and_gradients(tiny_path: Path, reduction: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    samples = [*forks_at_depths(3), *multi_context_session(4), *mixed_group(5)]
    loss = LossSettings(**{**RICH_LOSS, "loss_reduction": reduction})  # type: ignore[arg-type]
    trees = count_tree_forwards(monkeypatch)
    results = []
    for tree in (False, True):
        t = trainer(tiny_path, tree=tree, loss=loss)
        grads = record_gradients(t)
        results.append((t.train(samples), grads))
    assert len(trees) == 3, "old logprobs, reference logprobs and the trained forward, each through the trees"
    (metrics, grads), (tree_metrics, tree_grads) = results
    for key, value in metrics.items():
        if key.startswith("train/"):
            assert tree_metrics[key] == pytest.approx(value, abs=SUM_ATOL, rel=GRAD_RTOL), key
    for name, grad in grads.items():
        torch.testing.assert_close(tree_grads[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


def test_auto_packs_trees_only_where_they_cost_less(tiny_path: Path) -> None:
    rng = random.Random(6)
    unrelated = [make_row(rng, tokens(rng, 40), 20) for _ in range(4)]
    assert collate(unrelated, 0, "cpu", "auto").tree is None, "nothing shared: the padded rows"
    session = forked_session(rng, tokens(rng, 30), turns=6)
    packed = collate(session, 0, "cpu", "auto").tree
    assert packed is not None and packed.input_ids.shape[0] == 1, "a forked session is one tree"
    assert packed.computed == 30 + 12 + 5 * 11 + 6 * 9, "the prompt, 5 rewritten turns, 6 generated turns, once"


DEEPSPEED_WARNINGS = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def deepspeed_step(path: Path, stage: int, tree: bool, samples: list[Sample],
                   loss: LossSettings) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One `DeepSpeedTrainer.train` (ZeRO `stage`, one rank, gloo on the CPU): its metrics and weights after."""
    from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer

    batching = BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=256, tree=tree)
    ds = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=stage, batching=batching, loss=loss),
                          TrainerRun(str(path), advantages=AdvantageSettings(normalize_advantages=True)))
    try:
        return ds.train(samples), ds.engine_weights()
    finally:
        ds.close()


@DEEPSPEED_WARNINGS
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_tree_step_equals_its_rows_step(tiny_path: Path, stage: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    samples = [*forks_at_depths(7), *mixed_group(8)]
    loss = LossSettings(**{**RICH_LOSS, "loss_reduction": "seq_mean_token_mean"})  # type: ignore[arg-type]
    expected, weights = deepspeed_step(tiny_path, stage, False, samples, loss)
    trees = count_tree_forwards(monkeypatch)
    metrics, tree_weights = deepspeed_step(tiny_path, stage, True, samples, loss)
    assert trees, "the DeepSpeed step ran packed trees"
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/kl", "train/grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], abs=SUM_ATOL, rel=GRAD_RTOL), key
    for key, value in weights.items():
        # Adam's first step is lr*g/(|g|+eps): where a gradient is near 0, rounding moves a weight by a share of lr
        torch.testing.assert_close(tree_weights[key], value, atol=OptimSettings().lr / 10, rtol=0, msg=key)


@DEEPSPEED_WARNINGS
def test_two_deepspeed_ranks_of_trees_take_the_one_rank_rows_step(tiny_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO 3 on 2 ranks (worker processes), each rank packing its share as trees, against 1 rank of rows."""
    pytest.importorskip("deepspeed")
    from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer

    samples = [*multi_context_session(9), *forks_at_depths(10)]
    loss = LossSettings(**{**RICH_LOSS, "loss_reduction": "token_mean"})  # type: ignore[arg-type]
    expected, weights = deepspeed_step(tiny_path, 3, False, samples, loss)
    trees = count_tree_forwards(monkeypatch)
    batching = BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=256, tree=True)
    ds = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=3, num_ranks=2, batching=batching, loss=loss),
                          TrainerRun(str(tiny_path), advantages=AdvantageSettings(normalize_advantages=True)))
    try:
        metrics, tree_weights = ds.train(samples), ds.engine_weights()
    finally:
        ds.close()
    assert trees, "rank 0 ran packed trees"
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/kl", "train/grad_norm"):
        assert metrics[key] == pytest.approx(expected[key], abs=SUM_ATOL, rel=GRAD_RTOL), key
    for key, value in weights.items():
        torch.testing.assert_close(tree_weights[key], value, atol=OptimSettings().lr / 10, rtol=0, msg=key)
