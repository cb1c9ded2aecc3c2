"""Checkpoints that are models: every checkpoint folder of both trainer backends loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` (config, generation config,
tokenizer, chat template; tied weights stay tied); `save_optimizer=False` writes weights only and a resume
from it restarts the optimizer and says so (DeepSpeed: the fp32 master copies follow the loaded weights);
`trainer.keep_checkpoints` keeps the last N step folders. Real trainers on the tiny model.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from relax_pipeline.forest.sample import Sample
from relax_pipeline.loop import Checkpoints
from relax_pipeline.models.spec import ModelSettings, ModelSpec
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.optim import OptimSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun, TrainerSettings
from relax_pipeline.train.torch_backend import CheckpointWriteError, TorchTrainer, atomic_folder

SETTINGS = {"batching": BatchSettings(micro_batch_size=2), "optim": OptimSettings(lr=5e-3)}


def samples(count: int, seed: int) -> list[Sample]:
    """Random prompts and responses (the tiny model's outputs are noise anyway), off-policy logprobs."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt, response = rng.randint(2, 12), rng.randint(1, 8)
        tokens = tuple(rng.randrange(10, 1000) for _ in range(prompt + response))
        out.append(Sample(tokens, prompt, (1,) * response, (-5.0,) * response, advantage=rng.uniform(-1.0, 1.0)))
    return out


def assert_loadable(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    """The folder is a Hugging Face model folder holding `expected`, with tied embeddings and a chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder)
    state = model.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tied weights stay tied"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in rendered
    GenerationConfig.from_pretrained(folder)
    assert ModelSpec(ModelSettings(path=str(folder))).resolve() == folder


def test_a_checkpoint_is_a_model_folder_and_weights_only_resumes_with_a_fresh_optimizer(
        tiny_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    full, light = (TorchTrainer(TrainerSettings(save_optimizer=keep, **SETTINGS),
                                TrainerRun(str(tiny_path))) for keep in (True, False))
    for t, name in ((full, "full"), (light, "light")):
        t.train(samples(4, seed=1))
        t.save(tmp_path / name, {"step": 1})
    assert (tmp_path / "full" / "optimizer.pt").exists() and not (tmp_path / "light" / "optimizer.pt").exists()
    assert_loadable(tmp_path / "full", full.engine_weights())
    assert_loadable(tmp_path / "light", light.engine_weights())

    resumed = TorchTrainer(TrainerSettings(**SETTINGS), TrainerRun(str(tiny_path)))
    with caplog.at_level(logging.WARNING):
        assert resumed.load(tmp_path / "light") == {"step": 1} and resumed.version == 1
    assert "holds no optimizer state (saved with trainer.save_optimizer=false)" in caplog.text
    assert not resumed.optimizer.state_dict()["state"], "the optimizer starts fresh"
    assert all(torch.equal(v, light.engine_weights()[k]) for k, v in resumed.engine_weights().items())
    again = TorchTrainer(TrainerSettings(**SETTINGS),
                         TrainerRun(str(tmp_path / "full")))  # a checkpoint is a model.path
    assert all(torch.equal(v, full.engine_weights()[k]) for k, v in again.engine_weights().items())


def test_keep_checkpoints_keeps_the_last_n(tmp_path: Path) -> None:
    for step in (1, 2, 10, 3):
        (tmp_path / f"step_{step}").mkdir()
    (tmp_path / "notes").mkdir()
    removed = Checkpoints(tmp_path, None, False, keep=2).prune()
    assert sorted(p.name for p in removed) == ["step_1", "step_2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step_10", "step_3"]
    assert Checkpoints(tmp_path, None, False).prune() == []
    with pytest.raises(ValueError, match="trainer.keep_checkpoints=0 must be at least 1"):
        Checkpoints(tmp_path, None, False, keep=0)


def test_a_checkpoint_that_cannot_be_written_leaves_the_last_one_and_names_the_fix(tmp_path: Path) -> None:
    """A full disk mid-write (torch.save raises a RuntimeError): the partial folder goes, the previous stands."""
    def fill(folder: Path, text: str) -> None:
        (folder / "weights").write_text(text)

    def full_disk(folder: Path, text: str) -> None:
        fill(folder, text)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 967411968 vs 967411860")

    atomic_folder(tmp_path / "step_1", fill, "one")
    with pytest.raises(CheckpointWriteError, match=r"GB free on its disk.*trainer.keep_checkpoints") as caught:
        atomic_folder(tmp_path / "step_1", full_disk, "two")
    assert "unexpected pos" in str(caught.value) and "step_1" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"], "no partial folder is left"
    assert (tmp_path / "step_1" / "weights").read_text() == "one"

    def rank_failed(folder: Path, text: str) -> None:
        fill(folder, text)
        raise RuntimeError("trainer rank 1 exited")  # RankFailed is a RuntimeError

    with pytest.raises(RuntimeError, match="rank 1 exited") as other:  # not the disk: the caller's own error, unwrapped
        atomic_folder(tmp_path / "step_1", rank_failed, "three")
    assert not isinstance(other.value, CheckpointWriteError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoints_are_model_folders_and_resume_weights_only(tiny_path: Path, tmp_path: Path,
                                                                          stage: int) -> None:
    pytest.importorskip("deepspeed")
    from relax_pipeline.train.deepspeed_backend import DS_TAG, DeepSpeedTrainer

    first, second = samples(4, seed=2), samples(4, seed=3)
    ds = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=stage, save_optimizer=False, **SETTINGS),
                          TrainerRun(str(tiny_path)))
    try:
        ds.train(first)
        ds.save(tmp_path / "ckpt", {"step": 1})
        saved = ds.engine_weights()
    finally:
        ds.close()
    assert not (tmp_path / "ckpt" / DS_TAG).exists()
    assert_loadable(tmp_path / "ckpt", saved)
    reference = TorchTrainer(TrainerSettings(**SETTINGS), TrainerRun(str(tiny_path)))
    reference.load(tmp_path / "ckpt")
    reference.train(second)
    resumed = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=stage, **SETTINGS), TrainerRun(str(tiny_path)))
    try:
        assert resumed.load(tmp_path / "ckpt") == {"step": 1} and resumed.version == 1
        assert all(torch.equal(v, saved[k]) for k, v in resumed.engine_weights().items())
        resumed.train(second)  # trains from the loaded weights, not from stale fp32 master copies
        after = resumed.engine_weights()
    finally:
        resumed.close()
    expected = reference.engine_weights()
    assert all(torch.allclose(after[k], expected[k], atol=5e-4, rtol=0) for k in expected)
