"""`train/version_lag_kl/<k>` through a real training step on the tiny model (train/provenance.py, step.py).

The scripted batch knows every token's lag (its weight versions against the trainer's version) and its sampling
logprob: the policy's own logprob minus a known offset per lag bucket, so each bucket's k3 KL is known exactly."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.settings import TrainerRun, TrainerSettings
from relax_pipeline.train.step import collate, response_logprobs
from relax_pipeline.train.torch_backend import TorchTrainer

OFFSET = {0: 0.0, 1: 0.2, 2: -0.3, 4: 0.5}
"""log π - log μ of every loss token at that lag (4: the `4+` bucket, a token sampled 6 versions back)."""
VERSIONS = {0: 6, 1: 5, 2: 4, 4: 0}


def scripted(trainer: TorchTrainer, count: int = 6) -> list[Sample]:
    """Random tokens; each response token's version cycles through the lags, its rollout logprob is the policy's
    logprob at that token minus the lag's offset (observation tokens: mask 0)."""
    rng, samples = random.Random(1), []
    for _ in range(count):
        prompt, size = rng.randint(3, 9), rng.randint(4, 9)
        tokens = tuple(rng.randrange(10, 1000) for _ in range(prompt + size))
        lags = [list(OFFSET)[j % len(OFFSET)] for j in range(size)]
        mask = tuple(0 if j == 2 else 1 for j in range(size))
        samples.append(Sample(tokens, prompt, mask, (0.0,) * size, tuple(VERSIONS[lag] for lag in lags),
                              advantage=rng.uniform(-1, 1)))
    with torch.no_grad():
        policy = response_logprobs(trainer.policy, collate(samples, trainer.pad_id, "cpu"), 1.0)[0]
    return [_with_rollout(s, policy[i]) for i, s in enumerate(samples)]


def _with_rollout(sample: Sample, policy: torch.Tensor) -> Sample:
    lags = {v: lag for lag, v in VERSIONS.items()}
    rollout = tuple(float(policy[j]) - OFFSET[lags[v]] if m else 0.0
                    for j, (m, v) in enumerate(zip(sample.loss_mask, sample.weight_versions, strict=True)))
    return Sample(sample.tokens, sample.prompt_length, sample.loss_mask, rollout, sample.weight_versions,
                  advantage=sample.advantage)


@pytest.mark.parametrize("micro_batch_size", [2, 6])
def test_kl_per_lag_bucket_is_exact_on_a_scripted_step(tiny_path: Path, micro_batch_size: int) -> None:
    trainer = TorchTrainer(TrainerSettings(batching=BatchSettings(micro_batch_size=micro_batch_size)),
                           TrainerRun(str(tiny_path)))
    trainer.version = 6
    metrics = trainer.train(scripted(trainer))
    for lag, label in ((0, "0"), (1, "1"), (2, "2"), (4, "4+")):
        expected = math.expm1(OFFSET[lag]) - OFFSET[lag]
        assert metrics[f"train/version_lag_kl/{label}"] == pytest.approx(expected, abs=1e-5), label
    assert "train/version_lag_kl/3" not in metrics, "no token is 3 versions behind"
    assert metrics["train/version_lag/3"] == 0.0 and metrics["train/version_lag/4+"] > 0
