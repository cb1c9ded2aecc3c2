"""`trainer.lora`: the policy trained as a PEFT LoRA adapter over frozen base weights.

`LoraSettings` is the `trainer.lora` node (rank, alpha, dropout, target modules, the base weights' dtype); LoRA is
on when `rank` is set. `wrap` makes the loaded policy a PEFT model (`peft.get_peft_model`, adapter
`engine.base.DEFAULT_ADAPTER`): the base weights stay frozen in `base_dtype` (the engine's dtype, so the trainer
computes what the engine serves), the adapter's weights are float32 (PEFT's upcast) and are the only parameters
with gradients, hence the only ones AdamW keeps state for. A bad setting fails here naming its key: a rank of
0 or less, target modules that match no module of the model, a model type PEFT has no default target modules
for.

`adapter_weights` is what the weight sync sends the engine (`engine.base.AdapterWeights`: PEFT's config and
state dict of the adapter, on the CPU); `save_adapter`/`load_adapter` write and read a checkpoint's adapter as
a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), which `PeftModel.from_pretrained` and
`model.path=` load. `merged_state` is the base's state dict with the adapter added in (what a full-weights
engine would serve).

Dropout (`trainer.lora.dropout` > 0) applies only to forwards that record gradients (the loss); the logprobs
computed without gradient (old policy, reference) see no dropout, as the engine does.

What it does not do: other PEFT methods (DoRA, prompt tuning), or more than one adapter per trainer (several
policies are several adapters, one per policy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relax_pipeline.engine.base import DEFAULT_ADAPTER, AdapterWeights
from relax_pipeline.models.adapter_folder import ADAPTER_WEIGHTS

BASE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class LoraSettings:
    """The `trainer.lora` node; connects the `trainer` config group to PEFT's `LoraConfig`."""

    rank: int | None = None
    """LoRA rank r; null trains every weight (full fine-tuning)."""
    alpha: float | None = None
    """LoRA alpha: the adapter's output is scaled by alpha / rank; null: 32 (scale independent of a rank sweep's
    learning rate, as "LoRA Without Regret" recommends a fixed alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in the loss's forward (never in logprobs the engine must match)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names (suffixes) that get an adapter, or `[all-linear]`: every linear layer but the LM head."""
    base_dtype: str = "float32"
    """dtype of the frozen base weights; the trainer presets set the engine's (`engine.dtype`)."""

    def __post_init__(self) -> None:
        if self.rank is not None and not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"trainer.lora.rank={self.rank}; use a positive integer (8-64 is usual), or null for "
                             "full fine-tuning")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"trainer.lora.alpha={self.alpha}; use a positive number, or null for 32")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.dropout={self.dropout}; use a value in [0, 1)")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"trainer.lora.base_dtype={self.base_dtype!r}; choose one of {', '.join(BASE_DTYPES)}")
        if not self.target_modules:
            raise ValueError("trainer.lora.target_modules=[]: name the modules (e.g. [q_proj,v_proj]) or use "
                             "[all-linear]")

    @property
    def enabled(self) -> bool:
        """Whether the trainer trains an adapter (a rank is set)."""
        return self.rank is not None

    @property
    def dtype(self) -> torch.dtype:
        """The base weights' torch dtype."""
        return getattr(torch, self.base_dtype)


def lora_config(settings: LoraSettings) -> Any:
    """PEFT's `LoraConfig` of `settings`."""
    from peft import LoraConfig

    targets = list(settings.target_modules)
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha or 32.0, lora_dropout=settings.dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets, bias="none",
                      task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """`model` as a PEFT model with one trainable adapter (`DEFAULT_ADAPTER`); the base frozen; errors name the key."""
    from peft import get_peft_model

    model_type = getattr(model.config, "model_type", "?")
    try:
        peft_model = get_peft_model(model, lora_config(settings), adapter_name=DEFAULT_ADAPTER)
    except ValueError as error:
        raise ValueError(f"trainer.lora.target_modules={list(settings.target_modules)}: PEFT cannot place LoRA on "
                         f"this {model_type!r} model ({error}); its linear modules are {linear_names(model)[:12]}; "
                         "name some of them or use [all-linear]") from None
    _dropout_with_gradients_only(peft_model)
    return peft_model.eval()


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of `model`'s linear layers (what `target_modules` may name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def _dropout_with_gradients_only(model: torch.nn.Module) -> None:
    """Each LoRA dropout module is active exactly in forwards that record gradients (see the module)."""
    def follow_grad_mode(module: torch.nn.Module, args: object) -> None:
        module.training = torch.is_grad_enabled()

    for name, module in model.named_modules():
        if ".lora_dropout." in f"{name}." and isinstance(module, torch.nn.Dropout):
            module.register_forward_pre_hook(follow_grad_mode)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that get gradients (the adapter's under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (`...lora_A.weight`), detached CPU copies."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=DEFAULT_ADAPTER)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def config_dict(model: Any) -> dict[str, Any]:
    """The adapter's PEFT config as the plain dict `adapter_config.json` holds."""
    config = model.peft_config[DEFAULT_ADAPTER].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def adapter_weights(model: Any, name: str = DEFAULT_ADAPTER) -> AdapterWeights:
    """What the weight sync sends the engine: the adapter's config and tensors, as adapter `name`."""
    return AdapterWeights(name, config_dict(model), adapter_state(model))


def save_adapter(model: Any, folder: Path) -> None:
    """The adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) at `folder`."""
    model.save_pretrained(str(folder), selected_adapters=[DEFAULT_ADAPTER])


def load_adapter(model: Any, folder: Path) -> None:
    """Load a `save_adapter` folder's tensors into `model`'s adapter; a mismatch names the missing keys."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = folder / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {folder} holds no {ADAPTER_WEIGHTS}: it was not written with "
                                "trainer.lora (a full-weights checkpoint resumes without trainer.lora.rank)")
    result = set_peft_model_state_dict(model, load_file(str(file)), adapter_name=DEFAULT_ADAPTER)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {folder}'s adapter does not match trainer.lora: missing {missing[:5]}, "
                         f"unexpected {list(result.unexpected_keys)[:5]}")


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict under transformers' names, each adapted weight replaced by a new tensor: the
    base weight plus the adapter's delta (PEFT's `get_delta_weight`); the others are the model's own tensors (tied
    ones stay one tensor)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {f"{name}.base_layer.weight": m.get_delta_weight(DEFAULT_ADAPTER) for name, m in base.named_modules()
              if isinstance(m, LoraLayer) and DEFAULT_ADAPTER in m.lora_A}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" not in name:
            value = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
            out[name.replace(".base_layer.", ".")] = value.detach()
    return out
