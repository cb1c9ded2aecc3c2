"""ModelSpec: where the policy's weights, tokenizer and chat template come from.

`path` names any local Hugging Face folder; without it the `tiny` (text) or `tiny_vl` (Qwen2-VL-style
vision-language) model is built locally from `seed` (no download). This module resolves the folder;
`load_pretrained` is the one loader engines and trainers share: a folder whose config has a
`vision_config` loads as an image-text-to-text model, any other as a causal LM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_pipeline.models.attention import GROUPED, register_grouped_attention

BUILT_LOCALLY: tuple[str, ...] = ("tiny", "tiny_vl")


@dataclass
class ModelSettings:
    """The `model` group's node; connects the config to the model spec its `_target_` names."""

    _target_: str = "relax_pipeline.models.spec.ModelSpec"
    """The spec class (`model=smollm2`: models/smollm2.py's SmolLM2Spec, which converts the packaged weights)."""
    name: str = "tiny"
    """Label echoed as the model id."""
    path: str | None = None
    """Local Hugging Face folder; None builds `name` (`tiny` or `tiny_vl`) locally."""
    cache_dir: str | None = None
    """Where the tiny model is built; None means $RELAX_CACHE_DIR or ~/.cache/relax_pipeline."""
    end_of_turn: str | None = None
    """Template end-of-turn token; None detects it from the chat template."""


class ModelSpec:
    """Model choice; connects the `model` config group to engines and trainers."""

    def __init__(self, settings: ModelSettings, seed: int = 0) -> None:
        self.name, self.path, self.cache_dir = settings.name, settings.path, settings.cache_dir
        self.end_of_turn = settings.end_of_turn
        self.seed = seed
        """The run's `seed`: the tiny models are built from it."""

    def resolve(self) -> Path:
        """The local folder to load, building the tiny model on first use."""
        if self.path is not None:
            folder = Path(self.path).expanduser()
            if not (folder / "config.json").exists():
                raise FileNotFoundError(f"model.path={self.path!r} is not a Hugging Face folder (no config.json)")
            return folder
        if self.name not in BUILT_LOCALLY:
            raise ValueError(f"model.name={self.name!r} needs model.path; only {BUILT_LOCALLY} are built locally")
        if self.name == "tiny_vl":
            from relax_pipeline.models.tiny_vl import build_tiny_vl

            return build_tiny_vl(self.cache_dir, self.seed)
        from relax_pipeline.models.tiny import build_tiny

        return build_tiny(self.cache_dir, self.seed)


def is_multimodal(model_path: str | Path) -> bool:
    """Whether the folder holds a vision-language model (its config has a `vision_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return "vision_config" in config


def context_len(model_path: str | Path) -> int:
    """The model's own maximum sequence length (`max_position_embeddings`, also under `text_config`)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(source.get(key), int) and source[key] > 0:
                return source[key]
    raise ValueError(f"{model_path}/config.json names no maximum length (max_position_embeddings); set "
                     "rollout.max_context_len")


def load_pretrained(model_path: str | Path, dtype: Any, attn_implementation: str | None = None) -> Any:
    """The model of a local folder in `dtype`: image-text-to-text for VL folders, else a causal LM; its
    attention kernel is transformers' default unless `attn_implementation` names one (`eager`, `sdpa`, or
    `grouped`: models/attention.py)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if attn_implementation == GROUPED:
        register_grouped_attention()

    auto = AutoModelForImageTextToText if is_multimodal(model_path) else AutoModelForCausalLM
    chosen = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return auto.from_pretrained(str(model_path), dtype=dtype, **chosen)
