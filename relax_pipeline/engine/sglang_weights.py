"""Weights on disk for `/update_weights_from_disk`: a state dict written as a loadable Hugging Face folder.

`write_weights(state_dict, model_path, folder)` copies the model folder's own files (config, generation
config, tokenizer, chat template; no weights) and writes the tensors as one `model.safetensors` (shared
tensors stored once under their first name, `format: pt` metadata, as `from_pretrained` and SGLang's
loader expect). The folder appears atomically: it is written beside its final name and renamed, so a
server never reads a half-written checkpoint. The trainer's own checkpoints (`train/`) are a separate
schedule; this folder exists only to hand the current weights to the servers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
"""Files of the model folder that hold weights (not copied: the new weights replace them)."""


def write_weights(state_dict: dict[str, Any], model_path: Path, folder: Path) -> Path:
    """Write `state_dict` with `model_path`'s model files as the folder `folder`; returns `folder`."""
    from safetensors.torch import save_file

    if not state_dict:
        raise ValueError("update_weights got an empty state dict: nothing to load on the SGLang servers")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for source in model_path.iterdir():
        if source.is_file() and not source.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(source, partial / source.name)
    save_file(_unique(state_dict), str(partial / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def _unique(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Each storage once (tied embeddings), contiguous, on the CPU."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().to("cpu").contiguous()
    return out
