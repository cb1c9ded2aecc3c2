"""The replay bundle's format: its version, its file names, and a reader that needs only json and safetensors.

A bundle is one folder per recorded step (`<output>/replay/step_<n>/`, written by `recorder.py`); the layout and
every field are documented in `format.md` beside this module. `read_bundle(folder)` loads one into plain Python
values and numpy arrays; it imports nothing else of the project (copy this file to read bundles anywhere), and it
refuses a bundle whose `format_version` it does not read, naming both versions.

What it does not do: write bundles (`recorder.py`) or re-execute them (`job.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
"""Bumped on any change a reader of the previous version would misread (a renamed or re-typed field or file)."""
MANIFEST = "bundle.json"
ROWS = "rows.jsonl"
CREDIT = "credit.jsonl"
BATCH = "batch.safetensors"
BATCH_INDEX = "batch.jsonl"
METRICS = "metrics.json"
CONFIG = "config.yaml"
BATCH_TENSORS = ("tokens", "token_offsets", "prompt_length", "loss_mask", "rollout_logprobs", "weight_versions",
                 "response_offsets", "advantage")
"""The tensors of `batch.safetensors` (format.md says each one's dtype and shape)."""


class BundleVersionError(ValueError):
    """A bundle written in a format version this reader does not read."""


def check_version(manifest: dict[str, Any], folder: Path | str) -> None:
    """Raise `BundleVersionError` naming both versions unless `manifest` is in `FORMAT_VERSION`."""
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise BundleVersionError(f"replay bundle {folder} has format_version={found!r}; this relax_pipeline reads "
                                 f"format_version={FORMAT_VERSION} only: replay it with the relax_pipeline version "
                                 f"that wrote it ({manifest.get('code_version', {}).get('package', 'unknown')})")


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """`bundle.json` of `folder`, its version checked; a clear error when the folder holds no bundle."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"replay.bundle={str(folder)!r} holds no {MANIFEST}: point it at a "
                                "<output>/replay/step_<n> folder written with debug.replay_bundle=true")
    manifest = json.loads(path.read_text())
    check_version(manifest, folder)
    return manifest


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file as a dict (an absent file: none)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_batch(folder: Path | str) -> list[dict[str, Any]]:
    """The trainer batch: one dict per credited row, in training order (tokens, prompt_length, loss_mask,
    rollout_logprobs, weight_versions, advantage, and the row's identity from `batch.jsonl`)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    index = read_jsonl(folder / BATCH_INDEX)
    if not index:
        return []
    t = load_file(str(folder / BATCH))
    tok, resp = t["token_offsets"], t["response_offsets"]
    return [{**index[i], "tokens": t["tokens"][tok[i]:tok[i + 1]].tolist(), "prompt_length": int(t["prompt_length"][i]),
             "loss_mask": t["loss_mask"][resp[i]:resp[i + 1]].tolist(),
             "rollout_logprobs": t["rollout_logprobs"][resp[i]:resp[i + 1]].tolist(),
             "weight_versions": t["weight_versions"][resp[i]:resp[i + 1]].tolist(),
             "advantage": float(t["advantage"][i])}
            for i in range(len(index))]


def read_bundle(folder: Path | str) -> dict[str, Any]:
    """The whole bundle: `manifest`, `rows`, `credit` (groups), `batch`, `metrics` and `config` (yaml text)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    return {"manifest": manifest, "rows": read_jsonl(folder / ROWS), "credit": read_jsonl(folder / CREDIT),
            "batch": read_batch(folder), "metrics": json.loads((folder / METRICS).read_text()),
            "config": (folder / CONFIG).read_text() if (folder / CONFIG).is_file() else ""}
