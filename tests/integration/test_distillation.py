"""`trainer.loss.distill_coef` with `trainer.teacher`: the reverse KL to a frozen teacher on the generated tokens.

The term is zero, and its gradient too, when the teacher is the policy (the step equals one without it); with a
different teacher, steps whose only loss is the distillation term bring the policy's logprobs of the sampled tokens
toward the teacher's; under `trainer=deepspeed` (ZeRO 2 and 3) a distillation step's loss, distillation term and
update equal the torch backend's; settings that cannot work fail before any model is loaded, naming the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.optim import OptimSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun, TrainerSettings
from relax_pipeline.train.step import collate, response_logprobs
from relax_pipeline.train.torch_backend import TorchTrainer
from tests.integration.test_trainer import DEEPSPEED_WARNINGS, assert_weights, make_samples, micro, weights

NO_CLIP = OptimSettings(lr=5e-3, grad_clip=0.0)


def trainer(model: Path, teacher: Path | None = None, coef: float = 0.0, **loss: object) -> TorchTrainer:
    settings = TrainerSettings(loss=LossSettings(distill_coef=coef, **loss), batching=micro(4), optim=NO_CLIP,  # type: ignore[arg-type]
                               teacher=None if teacher is None else str(teacher))
    return TorchTrainer(settings, TrainerRun(str(model)))


def mean_k1(t: TorchTrainer, samples: list) -> float:
    """Mean over generated tokens of log policy - log teacher on the sampled tokens."""
    batch = collate(samples, t.pad_id, t.device)
    with torch.no_grad():
        ours = response_logprobs(t.policy, batch, 1.0)[0]
        theirs = response_logprobs(t.teacher, batch, 1.0)[0]
    mask = batch.loss_mask
    return float(((ours - theirs) * mask).sum() / mask.sum())


def test_the_term_is_zero_when_the_teacher_is_the_policy(tiny_path: Path) -> None:
    samples = make_samples(4, seed=3, logprob=-3.0)
    plain, distilled = trainer(tiny_path), trainer(tiny_path, teacher=tiny_path, coef=0.5)
    metrics, plain_metrics = distilled.train(samples), plain.train(samples)
    assert metrics["train/distill_loss"] == 0.0 and "train/distill_loss" not in plain_metrics
    assert metrics["train/loss"] == plain_metrics["train/loss"]
    assert_weights(weights(distilled), weights(plain), exact=True)


@pytest.fixture(scope="module")
def teacher(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a few steps of ordinary training: the same tokenizer, other weights."""
    t = trainer(tiny_path)
    for seed in range(3):
        t.train(make_samples(8, seed=seed, logprob=-3.0))
    folder = tmp_path_factory.mktemp("teacher") / "teacher"
    t.save(folder, {})
    return folder


def test_distillation_alone_moves_the_policy_toward_the_teacher(tiny_path: Path, teacher: Path) -> None:
    samples = [dataclasses.replace(s, advantage=0.0) for s in make_samples(8, seed=11, logprob=-3.0)]
    t = trainer(tiny_path, teacher=teacher, coef=1.0)
    before = abs(mean_k1(t, samples))
    assert before > 1e-3, "the teacher differs from the starting policy"
    losses = [t.train(samples)["train/distill_loss"] for _ in range(5)]
    assert losses[-1] < losses[0] and abs(mean_k1(t, samples)) < before


@pytest.mark.parametrize("make, fragment", [
    (lambda: TrainerSettings(loss=LossSettings(distill_coef=0.5)), "set both"),
    (lambda: TrainerSettings(teacher="/some/folder"), "trainer.loss.distill_coef=0.0 and trainer.teacher="),
    (lambda: LossSettings(distill_coef=-1.0), "trainer.loss.distill_coef=-1.0"),
])
def test_bad_settings_fail_naming_the_key(make: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        make()  # type: ignore[operator]


def test_a_teacher_that_is_not_a_model_folder_fails_naming_the_key(tiny_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer\.teacher='.*' is not a Hugging Face folder"):
        trainer(tiny_path, teacher=tmp_path, coef=0.5)


@DEEPSPEED_WARNINGS
@pytest.mark.parametrize("stage", [2, 3])
def test_a_distillation_step_under_deepspeed_equals_the_torch_path(tiny_path: Path, teacher: Path,
                                                                   stage: int) -> None:
    pytest.importorskip("deepspeed", reason="pip install -e '.[deepspeed]'")
    from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer

    samples = make_samples(4, seed=5, logprob=-3.0)
    torch_path = trainer(tiny_path, teacher=teacher, coef=0.5)
    expected = torch_path.train(samples)
    settings = DeepSpeedSettings(zero_stage=stage, loss=LossSettings(distill_coef=0.5), batching=micro(4),
                                 optim=NO_CLIP, teacher=str(teacher))
    ds = DeepSpeedTrainer(settings, TrainerRun(str(tiny_path)))
    try:
        got = ds.train(samples)
        after = ds.engine_weights()
    finally:
        ds.close()
    assert got["train/distill_loss"] > 0, "the teacher differs from the policy: the term is not zero"
    assert got["train/distill_loss"] == pytest.approx(expected["train/distill_loss"], rel=1e-5, abs=1e-7)
    assert got["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5, abs=1e-7)
    assert_weights(weights(torch_path), after, atol=NO_CLIP.lr / 10)
