"""Weights on disk for `/update_weights_from_disk`: a state dict written as a loadable Hugging Face folder.

`write_weights(state_dict, model_path, folder)` copies the model folder's own files and writes the tensors as
one `model.safetensors` (`models/folder.py`, as the trainer's checkpoints do). The folder appears atomically:
it is written beside its final name and renamed, so a server never reads a half-written checkpoint. The
trainer's own checkpoints (`train/`) are a separate schedule; this folder exists only to hand the current
weights to the servers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights


def write_weights(state_dict: dict[str, Any], model_path: Path, folder: Path) -> Path:
    """Write `state_dict` with `model_path`'s model files as the folder `folder`; returns `folder`."""
    if not state_dict:
        raise ValueError("update_weights got an empty state dict: nothing to load on the SGLang servers")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    copy_model_files(model_path, partial)
    save_weights(state_dict, partial / WEIGHTS_FILE)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
