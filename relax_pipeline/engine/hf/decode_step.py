"""The embedded engine's decode step for Llama-shaped models, written out op by op.

A decode step through transformers' `forward` spends part of every step (docs/benchmarks.md, "Engine") in what
is not arithmetic: module calls and their decorators, the mask machinery, the rotary
embedding recomputed for every step. `DecodeStep` runs the same tensor operations in the same order, so its
logits equal the model's own bit for bit (tests compare them), for a model this module knows the layout of
(`FITTING`: Llama, Qwen2, Qwen3, no sliding windows, a rotary embedding whose frequencies do not depend on the
length, plain `nn.Linear` layers or PEFT's LoRA layers over them (called through PEFT's forward with each row's
adapter, engine/hf/adapters.py), no hooks) under `grouped` attention (models/attention.py), whose decode kernel
it calls. Besides skipping the Python: the rotary cos/sin of every position is computed once (by the model's
own rotary module) and looked up per step, the additive mask is built once per step for all layers, the
residual adds write into the sum's operand instead of a new tensor, and on a CPU q/k/v and gate/up each run as
one matrix product over stacked weights (`Fused`: the modules' parameters become views of the stack, so the
model's own forward, used for prefill, reads the same weights).

`decode_step(model)` returns None (and the engine keeps transformers' forward) for any other model; `why_not`
says why. It reads the model's weights at every call, so weight updates apply at the next step. It does no
prefill, no images (mrope), no sampling; `hf.batch.ModelCall.decode` calls it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from relax_pipeline.models.attention import GROUPED, grouped_attention

FITTING = {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "qwen3": "Qwen3RMSNorm"}
"""Model types whose decoder layer `DecodeStep` writes out, with the norm class the layer must use."""
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
"""Rotary types whose frequencies are fixed at load, so a per-position table is exact."""
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def why_not(model: torch.nn.Module) -> str | None:
    """Why `DecodeStep` cannot run `model` exactly, or None when it can."""
    config = model.config
    if config.model_type not in FITTING:
        return f"model type {config.model_type!r} is not one of {sorted(FITTING)}"
    if getattr(config, "_attn_implementation", None) != GROUPED:
        return f"attention is {config._attn_implementation!r}, not {GROUPED!r}"
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                              or ()):
        return "the model has sliding-window layers"
    if getattr(model.model.rotary_emb, "rope_type", None) not in STATIC_ROPE or config.hidden_act != "silu":
        return f"rotary type {getattr(model.model.rotary_emb, 'rope_type', None)!r} / act {config.hidden_act!r}"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a module has forward hooks"
    layers = model.model.layers
    linear = [model.lm_head] + [layer.get_submodule(name) for layer in layers for name in PROJECTIONS]
    if any(type(m) is not torch.nn.Linear and not is_lora(m) for m in linear):
        return "a projection is neither a plain nn.Linear nor PEFT's LoRA layer over one"
    norms = [model.model.norm] + [norm for layer in layers
                                  for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n).__name__ != FITTING[config.model_type] for n in norms):
        return "a norm is not the model's own RMSNorm"
    return None


def is_lora(module: torch.nn.Module) -> bool:
    """Whether `module` is PEFT's LoRA linear layer over a plain `nn.Linear` (engine/hf/adapters.py puts them in)."""
    return type(module).__module__.startswith("peft.") and type(getattr(module, "base_layer", None)) is torch.nn.Linear


FUSED_ATTENTION = ("q_proj", "k_proj", "v_proj")
FUSED_MLP = ("gate_proj", "up_proj")


class Fused:
    """Linear layers of one input run as one matrix product: their weights become consecutive rows of one
    tensor (the modules keep their parameters, now views of it, so `load_state_dict` and in-place updates reach
    it), and a call returns each layer's output as a view of the product. One product of the stacked rows equals
    the separate products bit for bit on a CPU (oneDNN reduces each output over the input the same way; tests
    compare), and one product costs less than two (docs/benchmarks.md, "Engine"). Should a parameter be replaced
    by another tensor, the next call stacks again. Layers with biases, and LoRA layers (their adapters' products
    are per layer), are left alone (`None` from `stacked`)."""

    def __init__(self, parent: torch.nn.Module, names: tuple[str, ...]) -> None:
        self.modules = [parent.get_submodule(name) for name in names]
        self.sizes = [m.weight.shape[0] for m in self.modules]
        self.weight = self._stack()

    def __call__(self, hidden: torch.Tensor, adapters: list[str] | None = None) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(linear(m, hidden, adapters) for m in self.modules)
        if not self._intact():
            self.weight = self._stack()
        return torch.nn.functional.linear(hidden, self.weight).split(self.sizes, dim=-1)

    def _stack(self) -> torch.Tensor | None:
        if any(type(m) is not torch.nn.Linear or m.bias is not None for m in self.modules):
            return None
        weight = torch.cat([m.weight.detach() for m in self.modules])
        for module, part in zip(self.modules, weight.split(self.sizes), strict=True):
            module.weight.data = part
        self._starts = [m.weight.data_ptr() for m in self.modules]
        return weight

    def _intact(self) -> bool:
        """Whether every module's weight is still its view of the stacked weight."""
        return all(m.weight.data_ptr() == start for m, start in zip(self.modules, self._starts, strict=True))


def decode_step(model: torch.nn.Module) -> DecodeStep | None:
    """A `DecodeStep` for `model`, or None when `why_not` names a reason."""
    return None if why_not(model) else DecodeStep(model)


def rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The models' RMSNorm, its operations in its order (float32 statistics, the weight applied in `hidden`'s
    dtype)."""
    scaled = hidden.to(torch.float32)
    variance = scaled.pow(2).mean(-1, keepdim=True)
    scaled = scaled * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * scaled.to(hidden.dtype)


def rotated(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`states * cos + rotate_half(states) * sin`, as transformers' `apply_rotary_pos_emb`."""
    half = states.shape[-1] // 2
    return (states * cos) + (torch.cat((-states[..., half:], states[..., :half]), dim=-1) * sin)


def linear(module: torch.nn.Module, hidden: torch.Tensor, adapters: list[str] | None = None) -> torch.Tensor:
    """`module(hidden)`: a plain linear without the module call; PEFT's LoRA layer through its own forward, with
    each row's adapter (`adapters`, PEFT's `adapter_names`) when given."""
    if type(module) is torch.nn.Linear:
        return torch.nn.functional.linear(hidden, module.weight, module.bias)
    return module(hidden) if adapters is None else module(hidden, adapter_names=adapters)


class DecodeStep:
    """One decode step of a fitting model (`why_not` is None): logits [rows, vocab] of one new token per row.

    The rotary table (cos and sin per position, `[positions, head_dim]` in the model's dtype) grows by doubling
    as positions exceed it; it holds what the model's rotary module returns for those positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = list(model.model.layers)
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._cos = self._sin = torch.empty(0)
        cpu = next(model.parameters()).device.type == "cpu"
        self.fused = [(Fused(layer.self_attn, FUSED_ATTENTION), Fused(layer.mlp, FUSED_MLP)) if cpu else None
                      for layer in self.layers]
        """Per layer, q/k/v and gate/up as one product each (`Fused`), on a CPU only."""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: DynamicCache,
                 adapters: list[str] | None = None) -> torch.Tensor:
        """Logits of `ids` [rows, 1] at `positions` [rows, 1]; `mask` [rows, columns] marks each row's tokens,
        this one's included (the last column); `cache` holds one `SpareLayer` per layer and grows by a column;
        `adapters` names each row's LoRA adapter (None: the model has none)."""
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"decode step: the cache has {len(cache.layers)} layers, the model {len(self.layers)}; "
                             "prefill first")
        hidden = self.model.model.embed_tokens(ids)
        cos, sin = self._rotary(positions, hidden)
        bias = torch.zeros(mask.shape[0], 1, 1, mask.shape[1], dtype=hidden.dtype, device=hidden.device)
        bias.masked_fill_(mask[:, None, None, :] == 0, torch.finfo(hidden.dtype).min)
        for index, kv in enumerate(cache.layers):
            hidden = self._layer(index, kv, hidden, cos, sin, bias, adapters)
        return linear(self.model.lm_head, rms_norm(self.model.model.norm, hidden), adapters)[:, -1]

    def _layer(self, index: int, kv: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, bias: torch.Tensor, adapters: list[str] | None) -> torch.Tensor:
        """One decoder layer: attention over the cache, then the MLP, each around its residual."""
        layer, fused = self.layers[index], self.fused[index]
        attention = layer.self_attn
        normed = rms_norm(layer.input_layernorm, hidden)
        shape = (*hidden.shape[:-1], -1, self.head_dim)
        query, key, value = fused[0](normed, adapters) if fused else (
            linear(attention.get_submodule(name), normed, adapters) for name in FUSED_ATTENTION)
        query, key = query.view(shape), key.view(shape)
        if hasattr(attention, "q_norm"):  # Qwen3: a norm over each head
            query, key = rms_norm(attention.q_norm, query), rms_norm(attention.k_norm, key)
        value = value.view(shape).transpose(1, 2)
        query, key = rotated(query.transpose(1, 2), cos, sin), rotated(key.transpose(1, 2), cos, sin)
        keys, values = kv.update(key, value)
        out, _ = grouped_attention(attention, query, keys, values, bias, attention.scaling)
        hidden = linear(attention.o_proj, out.reshape(*hidden.shape[:-1], -1), adapters).add_(hidden)
        mlp, normed = layer.mlp, rms_norm(layer.post_attention_layernorm, hidden)
        gate, up = fused[1](normed, adapters) if fused else (linear(mlp.gate_proj, normed, adapters),
                                                             linear(mlp.up_proj, normed, adapters))
        return linear(mlp.down_proj, torch.nn.functional.silu(gate) * up, adapters).add_(hidden)

    def _rotary(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[rows, 1, 1, head_dim]` of `positions` [rows, 1] from the table (grown as needed)."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0] or self._cos.dtype != hidden.dtype or self._cos.device != hidden.device:
            count = max(need, 2 * self._cos.shape[0], 1024)
            every = torch.arange(count, device=hidden.device).unsqueeze(0)
            cos, sin = self.model.model.rotary_emb(hidden, every)
            self._cos, self._sin = cos[0], sin[0]
        return self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1)
