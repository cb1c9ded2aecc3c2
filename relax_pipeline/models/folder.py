"""Model folders on disk: the one way this package writes weights as a loadable Hugging Face folder.

`copy_model_files(model_path, folder)` copies a model folder's own files (config, generation config, tokenizer,
chat template, processor) and leaves weights, their indexes and training state behind (`WEIGHT_SUFFIXES`); a
folder without `generation_config.json` gets one from its config. `save_weights(weights, file)` writes a state
dict as one safetensors file, each shared tensor (tied embeddings) stored once under its first name, on the CPU,
marked `format: pt` as `from_pretrained` and SGLang's loader expect. The trainer's checkpoints
(`train/torch_backend.py`) and the SGLang engine's weight hand-over (`engine/sglang/weights.py`) both use them.
Not here: atomic renames and what else a checkpoint holds (each caller's own schedule).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
"""The weights file of a folder this package writes."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
"""Files of a model folder that `copy_model_files` leaves behind: weights, their indexes, training state."""


def copy_model_files(model_path: Path, folder: Path) -> None:
    """Copy `model_path`'s own files into `folder`, leaving weights and training state behind; give the folder a
    `generation_config.json` when the model path has none."""
    for source in model_path.iterdir():
        if source.is_file() and not source.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(source, folder / source.name)
    if not (folder / "generation_config.json").exists():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def save_weights(weights: dict[str, Any], file: Path) -> None:
    """One safetensors file of `weights`: each shared storage once, under its first name (Hugging Face ties the
    others again on load), contiguous and on the CPU."""
    from safetensors.torch import save_file

    seen: set[tuple[int, tuple[int, ...]]] = set()
    unique = {}
    for name, tensor in weights.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            unique[name] = tensor.detach().to("cpu").contiguous()
    save_file(unique, str(file), metadata={"format": "pt"})
