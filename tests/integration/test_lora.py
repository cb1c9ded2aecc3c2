"""LoRA (`trainer.lora`, train/lora.py) on the tiny model: what trains, what the engine serves, what a checkpoint is.

Real parts: PEFT's `LoraConfig`/`get_peft_model` in the trainer, PEFT's layers injected into the embedded engine
(engine/hf/adapters.py), the engine's async API, DeepSpeed ZeRO 0-3 on gloo. The engine's logprobs with an adapter
are compared with PEFT's own model (one full forward, float32) at 1e-6; the adapter's weights are drawn large
(std 0.3) so an adapter that was not applied, or applied to the wrong rows, moves them by far more.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_trainer import DEEPSPEED_WARNINGS, make_samples, micro

from relax_pipeline.engine.base import DEFAULT_ADAPTER, AdapterWeights, SamplingParams
from relax_pipeline.engine.hf.adapters import BASE
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.models.spec import load_pretrained
from relax_pipeline.train.lora import LoraSettings, adapter_weights, wrap
from relax_pipeline.train.optim import OptimSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun, TrainerSettings
from relax_pipeline.train.torch_backend import TorchTrainer

pytest.importorskip("peft", reason="trainer.lora needs PEFT: pip install -e '.[lora]'")
SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
EXACT = 1e-6


def prompt(length: int, offset: int = 0) -> list[int]:
    return [9 + (31 * i + 17 * offset) % 500 for i in range(length)]


def drawn_adapter(tiny_path: Path, seed: int, rank: int = 4) -> torch.nn.Module:
    """PEFT's model of the tiny model with an adapter of large random weights (float32)."""
    torch.manual_seed(seed)
    model = wrap(load_pretrained(tiny_path, torch.float32), LoraSettings(rank=rank))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def peft_logprobs(model: torch.nn.Module, ids: Sequence[int], output: Sequence[int]) -> list[float]:
    """log_softmax at each generated token from one full forward of PEFT's model over prompt + output."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids) + list(output)])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(ids) - 1 + i, t].item() for i, t in enumerate(output)]


def gap(a: Sequence[float], b: Sequence[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.asyncio
@pytest.mark.parametrize("attention", [None, "grouped"])
async def test_the_engine_serves_adapters_exactly_alone_and_mixed_in_one_batch(tiny_path: Path,
                                                                                attention: str | None) -> None:
    """`grouped` runs the written-out decode step (PEFT's layers called inside it), None transformers' forward."""
    first, second = drawn_adapter(tiny_path, 0), drawn_adapter(tiny_path, 1)
    engine = HFEngine(HFEngineSettings(attn_implementation=attention), EngineRun(str(tiny_path), seed=7))
    await engine.start()
    try:
        ids = prompt(13)
        plain = await engine.generate(ids, SAMPLING, rid="base")
        await engine.update_adapter(adapter_weights(first), 3)
        alone = await engine.generate(ids, SAMPLING, rid="alone")
        assert alone.output_ids != plain.output_ids and alone.weight_version == 3
        assert gap(alone.logprobs, peft_logprobs(first, ids, alone.output_ids)) <= EXACT
        await engine.update_adapter(AdapterWeights("second", *_parts(adapter_weights(second))), 5)
        mixed = await asyncio.gather(engine.generate(ids, SAMPLING, rid="a"),
                                     engine.generate(prompt(7, 1), SAMPLING, rid="b", adapter="second"),
                                     engine.generate(ids, SAMPLING, rid="c", adapter=BASE))
        assert engine.stats["max_batch"] == 3, "the three rows decoded in one batch"
        assert gap(mixed[0].logprobs, peft_logprobs(first, ids, mixed[0].output_ids)) <= EXACT
        assert gap(mixed[1].logprobs, peft_logprobs(second, prompt(7, 1), mixed[1].output_ids)) <= EXACT
        with first.disable_adapter():
            assert gap(mixed[2].logprobs, peft_logprobs(first, ids, mixed[2].output_ids)) <= EXACT
        assert mixed[0].output_ids == alone.output_ids and mixed[2].output_ids == plain.output_ids
        assert set(mixed[0].token_versions) == {3} and set(mixed[1].token_versions) == {5}
        with pytest.raises(ValueError, match="adapter 'third' is not loaded; the engine serves"):
            await engine.generate(ids, SAMPLING, rid="d", adapter="third")
    finally:
        await engine.close()


def _parts(adapter: AdapterWeights) -> tuple[dict, dict]:
    return adapter.config, adapter.tensors


def lora_trainer(tiny_path: Path, **lora: object) -> TorchTrainer:
    settings = TrainerSettings(batching=micro(2), optim=OptimSettings(lr=5e-3), lora=LoraSettings(**lora))
    return TorchTrainer(settings, TrainerRun(str(tiny_path)))


def test_only_the_adapter_trains_over_a_frozen_base_in_its_dtype(tiny_path: Path) -> None:
    trainer = lora_trainer(tiny_path, rank=4, base_dtype="bfloat16")
    base_before = {k: v.clone() for k, v in trainer.policy.get_base_model().state_dict().items() if ".lora_" not in k}
    adapter_before = trainer.engine_adapter().tensors
    metrics = trainer.train(make_samples(6))
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    trained = [p for p in trainer.policy.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    named = dict(trainer.policy.named_parameters())
    assert all(".lora_" in n for n, p in named.items() if p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for n, p in named.items() if ".lora_" not in n)
    state = trainer.optimizer.state_dict()["state"]
    assert len(state) == len(trained), "AdamW keeps state for the adapter's parameters alone"
    after = trainer.policy.get_base_model().state_dict()
    assert all(torch.equal(base_before[k], after[k]) for k in base_before)
    adapter_after = trainer.engine_adapter()
    assert adapter_after.name == DEFAULT_ADAPTER and adapter_after.config["r"] == 4
    assert any(not torch.equal(adapter_before[k], adapter_after.tensors[k]) for k in adapter_before)


def test_an_adapter_checkpoint_resumes_exactly_and_peft_loads_it(tiny_path: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    first, second = make_samples(6, seed=5), make_samples(6, seed=6)
    straight = lora_trainer(tiny_path, rank=4)
    straight.train(first)
    straight.save(tmp_path / "ckpt", {"step": 1})
    straight.train(second)
    resumed = lora_trainer(tiny_path, rank=4)
    assert resumed.load(tmp_path / "ckpt") == {"step": 1} and resumed.version == 1
    resumed.train(second)
    a, b = straight.engine_adapter().tensors, resumed.engine_adapter().tensors
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    loaded = PeftModel.from_pretrained(load_pretrained(tiny_path, torch.float32), tmp_path / "ckpt")
    ids = torch.tensor([prompt(9)])
    with torch.no_grad():
        expected = lora_trainer(tiny_path, rank=4)
        expected.load(tmp_path / "ckpt")
        assert torch.equal(loaded(input_ids=ids).logits, expected.policy(input_ids=ids).logits)


def test_dropout_acts_in_the_loss_forward_only(tiny_path: Path) -> None:
    trainer = lora_trainer(tiny_path, rank=4, dropout=0.5)
    with torch.no_grad():
        for name, param in trainer.policy.named_parameters():
            if ".lora_B" in name:
                param.fill_(0.1)
    ids = torch.tensor([prompt(9)])
    with torch.no_grad():
        twice = [trainer.policy(input_ids=ids).logits for _ in range(2)]
    assert torch.equal(*twice), "no dropout without gradients: the logprobs the engine must match"
    noisy = [trainer.policy(input_ids=ids).logits.detach() for _ in range(2)]
    assert not torch.equal(*noisy)


@DEEPSPEED_WARNINGS
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_trains_the_adapter_like_the_torch_backend(tiny_path: Path, stage: int) -> None:
    pytest.importorskip("deepspeed")
    from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer

    lora = LoraSettings(rank=4, base_dtype="bfloat16")
    reference = lora_trainer(tiny_path, rank=4, base_dtype="bfloat16")
    expected = reference.train(make_samples(6))
    ds = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=stage, batching=micro(2), optim=OptimSettings(lr=5e-3),
                                            lora=lora), TrainerRun(str(tiny_path)))
    try:
        metrics = ds.train(make_samples(6))
        adapter = ds.engine_adapter()
    finally:
        ds.close()
    assert metrics["train/loss"] == expected["train/loss"]
    assert metrics["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-6)
    ours = reference.engine_adapter().tensors
    assert adapter is not None and adapter.tensors.keys() == ours.keys()
    for key, tensor in ours.items():  # one Adam step from the same gradients (lr/10: float-order noise near 0)
        assert torch.allclose(adapter.tensors[key], tensor, atol=5e-4, rtol=0), key


@pytest.mark.parametrize("lora, fragment", [
    ({"rank": 0}, "trainer.lora.rank=0; use a positive integer"),
    ({"rank": -2}, "trainer.lora.rank=-2"),
    ({"rank": 4, "dropout": 1.0}, "trainer.lora.dropout=1.0"),
    ({"rank": 4, "base_dtype": "int8"}, "trainer.lora.base_dtype='int8'"),
])
def test_bad_lora_settings_name_the_key(lora: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LoraSettings(**lora)  # type: ignore[arg-type]


def test_target_modules_that_match_nothing_name_the_key_and_the_model_s_modules(tiny_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules=\['qkv'\].*'qwen3'.*q_proj"):
        lora_trainer(tiny_path, rank=4, target_modules=["qkv"])


class NoLinear(torch.nn.Module):
    """A model of a type PEFT cannot put LoRA on (`all-linear` needs a transformers model with linear layers)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig()
        self.config.model_type = "no_linear"
        self.embed = torch.nn.Embedding(8, 4)


def test_lora_on_a_model_peft_does_not_support_names_the_key() -> None:
    with pytest.raises(ValueError, match="trainer.lora.target_modules=\\['all-linear'\\]: PEFT cannot place LoRA on "
                                         "this 'no_linear' model"):
        wrap(NoLinear(), LoraSettings(rank=4))
