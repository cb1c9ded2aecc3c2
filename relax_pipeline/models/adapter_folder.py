"""PEFT adapter folders on disk: how to tell one from a model folder, its base model, and its tensors.

A LoRA checkpoint (`trainer.lora`, train/lora.py) is a PEFT folder: `adapter_config.json` (PEFT's `LoraConfig`,
whose `base_model_name_or_path` names the base model's folder) and `adapter_model.safetensors` (the adapter's
tensors under PEFT's saved names), beside the base's config, tokenizer and chat template files, so
`PeftModel.from_pretrained`, `AutoPeftModelForCausalLM.from_pretrained` and `model.path=` all load it. The
embedded engine serves such a folder as its base model plus the adapter (engine/hf/engine.py).

What it does not do: write the folder (PEFT's `save_pretrained` does, train/lora.py) or load the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(path: str | Path) -> bool:
    """Whether `path` is a PEFT adapter folder (it has `adapter_config.json`)."""
    return (Path(path).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_config(path: str | Path) -> dict[str, Any]:
    """The folder's `adapter_config.json`."""
    return json.loads((Path(path).expanduser() / ADAPTER_CONFIG).read_text())


def base_model(path: str | Path) -> Path:
    """The base model folder an adapter folder was trained over; an error names the key when it is gone."""
    named = adapter_config(path).get("base_model_name_or_path")
    if not named or not (Path(named).expanduser() / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(path)!r} is a LoRA adapter over {named!r}, which is not a model "
                                "folder here; put the base model there, or fix base_model_name_or_path in its "
                                f"{ADAPTER_CONFIG}")
    return Path(named).expanduser()


def adapter_tensors(path: str | Path) -> dict[str, Any]:
    """The folder's adapter tensors (CPU), under PEFT's saved names."""
    from safetensors.torch import load_file

    file = Path(path).expanduser() / ADAPTER_WEIGHTS
    if not file.is_file():
        raise FileNotFoundError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    return load_file(str(file))
