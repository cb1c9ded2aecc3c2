"""The lean norms and MLPs (train/lean_layers.py) and the grouped kernel's low-precision softmax
(models/attention.py): the same forward, gradients equal to rounding, less kept for the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relax_pipeline.models.attention import GROUPED, register_grouped_attention, softmax_probs
from relax_pipeline.train.lean_layers import lean_activations


def _model(kind: str) -> torch.nn.Module:
    register_grouped_attention()
    torch.manual_seed(0)
    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True, attn_implementation=GROUPED)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **sizes)).eval()


def _run(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict, int]:
    """Logits, parameter gradients and the bytes kept for the backward, of one forward and backward."""
    kept, _ = _kept_run(model, ids, autocast)
    return kept


def _kept_run(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[tuple, list]:
    """`_run`'s figures and the (shape, dtype) of each storage kept for the backward."""
    kept: dict[int, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape), t.dtype)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1)[..., 5].sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return (logits.detach(), grads, sum(size for size, _, _ in kept.values())), [k[1:] for k in kept.values()]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_same_forward_close_gradients_less_kept(kind: str) -> None:
    plain = _model(kind)
    lean = copy.deepcopy(plain)
    assert lean_activations(lean) == 2 * 2 + 1 + 2  # two norms and an MLP per layer, the final norm
    ids = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    logits, grads, kept = _run(plain, ids, autocast=True)
    lean_logits, lean_grads, lean_kept = _run(lean, ids, autocast=True)
    assert torch.equal(logits, lean_logits)
    for name, grad in grads.items():
        scale = grad.abs().max().item()
        assert torch.allclose(lean_grads[name], grad, rtol=0.05, atol=0.02 * scale), name
    assert lean_kept < 0.85 * kept


def test_attention_probabilities_kept_once_in_bf16() -> None:
    """Grouped attention's probabilities `[B, KVH, G * Q, L]`: eager kept them in float32 and bf16, lean in bf16."""
    model = _model("llama")
    ids = torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(1))
    _, kept = _kept_run(model, ids, autocast=True)
    probabilities = [dtype for shape, dtype in kept if shape[-2:] == (2 * 24, 24)]
    assert probabilities == [torch.bfloat16] * 2  # one per layer


def test_outside_autocast_nothing_changes() -> None:
    plain = _model("llama")
    lean = copy.deepcopy(plain)
    lean_activations(lean)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    logits, grads, kept = _run(plain, ids, autocast=False)
    lean_logits, lean_grads, lean_kept = _run(lean, ids, autocast=False)
    assert torch.equal(logits, lean_logits) and lean_kept == kept
    assert all(torch.equal(lean_grads[name], grad) for name, grad in grads.items())


def test_qwen3_head_norms_stay() -> None:
    model = _model("qwen3")
    lean_activations(model)
    attention = model.model.layers[0].self_attn
    assert "forward" not in vars(attention.q_norm) and "forward" not in vars(attention.k_norm)
    assert "forward" in vars(model.model.layers[0].input_layernorm) and "forward" in vars(model.model.norm)


def test_low_precision_softmax_keeps_bf16_probabilities() -> None:
    scores = torch.randn(2, 3, 5, 7, dtype=torch.float32, requires_grad=True)
    upstream = torch.randn(2, 3, 5, 7).to(torch.bfloat16)
    reference = torch.softmax(scores, dim=-1, dtype=torch.float32).to(torch.bfloat16)
    (reference.float() * upstream.float()).sum().backward()
    expected, scores.grad = scores.grad.clone(), None
    kept: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        probs = softmax_probs(scores, torch.bfloat16)
    assert torch.equal(probs, reference) and [t.dtype for t in kept] == [torch.bfloat16]
    (probs.float() * upstream.float()).sum().backward()
    assert torch.allclose(scores.grad, expected, atol=2e-2)
    with torch.no_grad():
        assert torch.equal(softmax_probs(scores, torch.float32), torch.softmax(scores, -1))


@pytest.mark.parametrize("lean", [True, False])
def test_trainer_key_swaps_the_policy_forwards(tiny_path, lean: bool) -> None:
    from relax_pipeline.train.settings import TrainerRun, TrainerSettings
    from relax_pipeline.train.torch_backend import TorchTrainer

    trainer = TorchTrainer(TrainerSettings(autocast="bfloat16", lean_activations=lean), TrainerRun(str(tiny_path)))
    try:
        assert ("forward" in vars(trainer.policy.model.layers[0].mlp)) is lean
    finally:
        trainer.close()
