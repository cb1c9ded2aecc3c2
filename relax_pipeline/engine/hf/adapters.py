"""The embedded engine's LoRA adapters: PEFT's own layers in the engine's model, several adapters at once.

`Adapters` puts each adapter the trainer sends (`engine.base.AdapterWeights`) into the engine's model with PEFT
(`inject_adapter_in_model` the first time a name is seen, then `set_peft_model_state_dict` at every sync): the base
weights stay as they are, in the engine's dtype, and the adapter's weights keep the trainer's float32. A forward
then names each row's adapter (`rows`): PEFT's mixed-batch path (`adapter_names`) runs every projection's base
product once for the whole batch and each adapter's low-rank product on the rows that name it, so one decode
batch serves rows of several adapters (and rows of none, `BASE`) at once. With one adapter for every row this is
the same arithmetic as PEFT's model with that adapter active (tests compare the logprobs): the adapter is applied
per row, never merged into the base weights, which would round its small update away in a bf16 engine and could
serve one adapter only (`bench/engine.py --case adapters` measures the cost against the base model).

What it does not do: other PEFT methods (DoRA, prompt tuning), adapters on embeddings, or unloading an adapter.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import torch

from relax_pipeline.engine.base import AdapterWeights

BASE = "__base__"
"""The adapter name of a row served by the base weights alone (PEFT's name for it in a mixed batch)."""
SAVED_PREFIX = "base_model.model."
"""How PEFT's saved names of a `PeftModel` begin; the engine's model is the bare model under it."""
SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias")
"""LoRA config keys that change the adapter's layers (a new sync must keep them)."""


class Adapters:
    """The adapters loaded into one model, by name; touched by the engine's worker thread only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.configs: dict[str, dict[str, Any]] = {}
        """Each loaded adapter's PEFT config (what `load` compares a later sync against)."""
        self.active: str | None = None
        """The adapter PEFT's layers run when a forward names none (`names`: a batch whose rows share one)."""

    def load(self, adapter: AdapterWeights) -> bool:
        """Load `adapter`'s weights (its layers injected the first time its name is seen); True when the model's
        modules changed (the caller rebuilds what holds them)."""
        from peft import set_peft_model_state_dict

        changed = adapter.name not in self.configs
        if changed:
            self._inject(adapter)
        elif _shape(self.configs[adapter.name]) != _shape(adapter.config):
            raise ValueError(f"adapter {adapter.name!r} changed its LoRA shape {_shape(self.configs[adapter.name])} "
                             f"-> {_shape(adapter.config)}; the engine keeps an adapter's rank and target modules")
        if changed:
            self.active = None  # PEFT made the new adapter its layers' active one
        tensors = {_bare(name): tensor for name, tensor in adapter.tensors.items()}
        with torch.inference_mode(False), torch.no_grad():
            result = set_peft_model_state_dict(self.model, tensors, adapter_name=adapter.name)
        if result.unexpected_keys:
            raise ValueError(f"adapter {adapter.name!r} has tensors the model has no place for: "
                             f"{list(result.unexpected_keys)[:5]}")
        return changed

    def _inject(self, adapter: AdapterWeights) -> None:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import cast_adapter_dtype

        known = {f.name for f in fields(LoraConfig)}
        config = LoraConfig(**{k: v for k, v in adapter.config.items() if k in known and k != "peft_type"})
        with torch.inference_mode(False), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Already found a `peft_config`")  # a second adapter: what we want
            inject_adapter_in_model(config, self.model, adapter_name=adapter.name)
            cast_adapter_dtype(self.model, adapter.name, autocast_adapter_dtype=True)
        self.configs[adapter.name] = dict(adapter.config)

    def names(self, rows: Sequence[str]) -> list[str] | None:
        """PEFT's `adapter_names` for a forward over rows of adapters `rows`: None (the layers' active adapter, made
        the rows' one) when every row has the same adapter, which spares PEFT's per-row gather and scatter; the
        rows' names otherwise, and while no adapter is loaded None (the plain model)."""
        if not self.configs:
            return None
        first = rows[0] if rows else BASE
        if first == BASE or any(name != first for name in rows):
            return list(rows)
        if self.active != first:
            self._activate(first)
        return None

    def _activate(self, name: str) -> None:
        from peft.tuners.lora import LoraLayer

        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                module.set_adapter(name, inference_mode=True)
        self.active = name

    @contextmanager
    def rows(self, names: Sequence[str] | None) -> Iterator[None]:
        """Forwards inside name each row's adapter (`names`, one per batch row; None: no adapter is loaded)."""
        if names is None or not self.configs:
            yield
            return
        from peft.tuners.lora import LoraLayer

        hook = _adapter_names_hook(list(names))
        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self.model.modules()
                   if isinstance(m, LoraLayer)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _adapter_names_hook(names: list[str]) -> Any:
    """A forward pre-hook giving a LoRA layer PEFT's `adapter_names` argument (PEFT's own hook does the same)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "adapter_names": names}
    return hook


def _bare(name: str) -> str:
    """A PEFT saved name relative to the bare model."""
    return name[len(SAVED_PREFIX):] if name.startswith(SAVED_PREFIX) else name


def _shape(config: dict[str, Any]) -> tuple:
    value = [config.get(k) for k in SHAPE_KEYS]
    return tuple(sorted(v) if isinstance(v, list | set) else v for v in value)
