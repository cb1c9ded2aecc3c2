"""`engine.decode_step`: the written-out decode step gives the model's own logits bit for bit.

Two caches are prefilled alike (rows of different lengths, so left padding is masked), then decoded side by side,
one through `DecodeStep`, one through the model's forward, with rows leaving in between (`hf.batch.take`): the
tiny Qwen3 (per-head q/k norms) and a small random Llama, in float32 and bfloat16, q/k/v and gate/up as one
product each (`Fused`) through weight updates. Models it does not fit (other attention, sliding windows, hooks)
fall back to the forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relax_pipeline.engine.hf.batch import Chunk, ModelCall, take
from relax_pipeline.engine.hf.decode_step import DecodeStep, decode_step, why_not
from relax_pipeline.models.attention import GROUPED, cache_argument, register_grouped_attention
from relax_pipeline.models.spec import load_pretrained


def small_llama(dtype: torch.dtype) -> torch.nn.Module:
    register_grouped_attention()
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attn_implementation=GROUPED)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def side_by_side(model: torch.nn.Module, steps: int = 12, step: DecodeStep | None = None) -> None:
    """Prefill 4 rows twice, decode both copies `steps` steps (the first through `step`, a new `DecodeStep` by
    default), dropping rows 1 and 3 halfway; every step's logits must be equal."""
    call, step = ModelCall(model), step or DecodeStep(model)
    generator = torch.Generator().manual_seed(1)
    chunks = [Chunk(0, (), tuple(torch.randint(1, 250, (n,), generator=generator).tolist())) for n in (3, 9, 5, 14)]
    with torch.inference_mode():
        runs = [call.prefill(chunks), call.prefill(chunks)]
        caches, masks = [r.cache for r in runs], [r.mask for r in runs]
        lengths = torch.tensor([len(c.tokens) for c in chunks])
        for index in range(steps):
            if index == steps // 2:
                for i in range(2):
                    caches[i], masks[i] = take(caches[i], masks[i], [0, 2])
                lengths = lengths[[0, 2]]
            ids = torch.randint(1, 250, (len(lengths), 1), generator=generator)
            positions = (lengths + index).unsqueeze(1)
            masks = [torch.cat([m, m.new_ones(len(lengths), 1)], dim=1) for m in masks]
            ours = step(ids, positions, masks[0], caches[0])
            theirs = model(input_ids=ids, attention_mask=masks[1], position_ids=positions, use_cache=True,
                           **{cache_argument(model): caches[1]}).logits[:, -1]
            assert torch.equal(ours, theirs), f"step {index}: {(ours.float() - theirs.float()).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_qwen3_decodes_the_forward_s_logits(tiny_path: Path, dtype: torch.dtype) -> None:
    model = load_pretrained(tiny_path, dtype, GROUPED).eval()
    assert why_not(model) is None
    side_by_side(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_llama_decodes_the_forward_s_logits(dtype: torch.dtype) -> None:
    model = small_llama(dtype)
    assert isinstance(ModelCall(model).step, DecodeStep)
    side_by_side(model, steps=40)  # past SpareLayer's spare columns: the cache regrows in between


def test_weight_updates_reach_the_stacked_products() -> None:
    """q/k/v and gate/up run as one product each over stacked weights: `load_state_dict` (what the engine's weight
    update does) writes through the modules' views, and a parameter given another tensor is stacked again."""
    model = small_llama(torch.float32)
    step = DecodeStep(model)
    generator = torch.Generator().manual_seed(3)
    new = {name: torch.randn(value.shape, generator=generator) * 0.1
           for name, value in model.state_dict().items() if name.endswith("proj.weight")}
    with torch.no_grad():
        model.load_state_dict(new, strict=False)
    side_by_side(model, steps=3, step=step)
    model.model.layers[1].mlp.up_proj.weight.data = torch.randn(96, 64, generator=generator)
    side_by_side(model, steps=3, step=step)
    assert step.fused[1][1]._intact()


def test_the_rotary_table_grows_past_its_first_size() -> None:
    model = small_llama(torch.float32)
    step = DecodeStep(model)
    hidden = torch.zeros(1, 1, 64)
    cos, sin = step._rotary(torch.tensor([[3]]), hidden)
    far = torch.tensor([[1500], [7]])
    cos, sin = step._rotary(far, hidden)
    expected = model.model.rotary_emb(hidden.expand(2, 1, 64), far)
    assert step._cos.shape[0] >= 1501
    assert torch.equal(cos[:, 0], expected[0]) and torch.equal(sin[:, 0], expected[1])


def test_models_it_does_not_fit_keep_the_forward(tiny_path: Path) -> None:
    assert "attention" in str(why_not(load_pretrained(tiny_path, torch.float32, "eager")))
    model = small_llama(torch.float32)
    model.model.layers[0].mlp.register_forward_hook(lambda *args: None)
    assert why_not(model) == "a module has forward hooks" and decode_step(model) is None
    sliding = small_llama(torch.float32)
    sliding.config.layer_types = ["sliding_attention"] * 3
    assert "sliding" in str(why_not(sliding))
