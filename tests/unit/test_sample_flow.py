"""One record from credit to the trainer's collate: the row the trainer trains on is the forest's `Sample` with
the credited advantage, and the padded batch (`Collated`) is the only other shape.

Credit scores a real group (`credit=reward`, grpo with std normalization), the step loop hands on the credited samples
(`loop.train_samples`), and the trainer's entry (`global_batches`), the rank split (`shard`) and `collate` take
them as they are; worker ranks get lean copies without the messages and context. No model is loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from pathlib import Path

import pytest

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.credit.reward import RewardCredit
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.forest.sample import Sample
from relax_pipeline.loop import train_samples
from relax_pipeline.stages.group import Group
from relax_pipeline.train.batching import BatchSettings, global_batches
from relax_pipeline.train.data_parallel import shard, training_row
from relax_pipeline.train.step import collate

TOOLS = ({"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}},)


def rollout_sample(first: int) -> Sample:
    """A sample as `build_sample` lays one out: tokens with their provenance (messages, context, hash)."""
    return Sample((1, 2, first, 4, 5), 2, (1, 0, 1), (-0.5, 0.0, -0.25), (0, 0, 1),
                  (Message("user", "What is 1 + 2?"), Message("assistant", "3")), Context(TOOLS), "ab" * 32, 2, False)


def scored_group(rewards: list[float]) -> tuple[Group, list[Sample]]:
    """A train group its contexts scored by `credit=reward` (grpo, std-normalized); the samples it started from."""
    samples = [rollout_sample(10 + i) for i in range(len(rewards))]
    contexts = [CreditContext(i, f"s{i}", None, s, {}, {}, r)
                for i, (s, r) in enumerate(zip(samples, rewards, strict=True))]
    asyncio.run(RewardCredit(CreditSettings()).score(CreditGroup("g", "train", len(rewards), contexts)))
    group = Group("g", Prompt(0, "What is 1 + 2?"), 0, "train", Path("."))
    group.contexts = contexts
    return group, samples


def test_the_trainer_row_is_the_forest_sample_with_its_credited_advantage() -> None:
    group, built = scored_group([1.0, 0.0, 0.5])
    rows = train_samples([group])
    assert [r.advantage for r in rows] == [c.advantage for c in group.contexts] == pytest.approx([1, -1, 0], abs=1e-5)
    for row, context, sample in zip(rows, group.contexts, built, strict=True):
        assert row is context.sample, "no copy between credit and the trainer"
        assert row == dataclasses.replace(sample, advantage=context.advantage), "every forest field kept"
        assert sample.advantage is None, "the forest's sample is not changed by credit"
    batch = collate(global_batches(rows, BatchSettings())[0], 0, "cpu")
    assert batch.base.tolist() == pytest.approx([1, -1, 0], abs=1e-5)
    assert batch.loss_mask.tolist() == [[1.0, 0.0, 1.0]] * 3


def test_only_credited_contexts_of_kept_groups_train() -> None:
    kept, _ = scored_group([1.0, 0.0])
    kept.contexts[1].advantage = None
    dropped, _ = scored_group([1.0, 0.0])
    dropped.dropped = "agent failed"
    assert train_samples([kept, dropped]) == [kept.contexts[0].sample]


def test_the_trainer_refuses_a_sample_without_credit_and_a_credited_one_checks_its_lengths() -> None:
    sample = rollout_sample(10)
    with pytest.raises(ValueError, match=r"sample 1 has no advantage \(Sample.advantage is None\)"):
        global_batches([dataclasses.replace(sample, advantage=1.0), sample], BatchSettings())
    with pytest.raises(ValueError, match="Sample.rollout_logprobs has 2 entries; response_length is 3"):
        dataclasses.replace(sample, rollout_logprobs=(0.0, 0.0), advantage=1.0)
    with pytest.raises(ValueError, match=r"Sample.prompt_length=0 must be in \[1, 5\]"):
        dataclasses.replace(sample, prompt_length=0, loss_mask=(1,) * 5, rollout_logprobs=(0.0,) * 5, advantage=1.0)


def test_worker_ranks_get_lean_rows_and_one_rank_the_samples_themselves() -> None:
    group, _ = scored_group([1.0, 0.0, 0.5, 0.25])
    rows = train_samples([group])
    one = shard(rows, 1, BatchSettings())[0]
    assert [s for b in one.micro_batches for s in b] == rows and one.micro_batches[0][0] is rows[0]
    lean = [s for share in shard(rows, 2, BatchSettings()) for b in share.micro_batches for s in b]
    assert sorted(lean, key=lambda s: s.tokens) == [training_row(r) for r in rows]
    for row in lean:
        assert (row.messages, row.context, row.state_hash) == ((), Context(), "") and row.advantage is not None
    whole, trimmed = len(pickle.dumps(rows)), len(pickle.dumps([training_row(r) for r in rows]))
    assert trimmed < whole, "a share on the wire carries no messages or context"
