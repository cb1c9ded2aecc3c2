"""How `engine=sglang` hands new weights to its servers (`engine.weight_transfer`).

- `disk` (the default): `write_weights(state_dict, model_path, folder)` copies the model folder's own files and
  writes the tensors as one `model.safetensors` (`models/folder.py`, as the trainer's checkpoints do), sent as
  `/update_weights_from_disk {model_path}`. The folder appears atomically: it is written beside its final name
  and renamed, so a server never reads a half-written checkpoint. It must be on storage the servers can read.
- `tensor`: `tensor_buckets` cuts the state dict into buckets of at most `BUCKET_BYTES` and `tensor_body` makes
  one `/update_weights_from_tensor` body of each (SGLang 0.5.23 `UpdateWeightsFromTensorReqInput`):
  `serialized_named_tensors` holds, once per tensor-parallel rank of the server, the base64 of a pickled list of
  `(name, tensor)` pairs (CPU tensors, data inline, so no shared memory or CUDA IPC is needed and the server may
  be another machine; SGLang's safe unpickler accepts exactly these globals). Only the last bucket sets
  `weight_version` (and flushes the cache), so the server serves the new version once every bucket is loaded.
- `distributed` (`/update_weights_from_distributed`, an NCCL broadcast from the trainer to the servers) needs
  CUDA and a process group between them; `check_transfer` refuses it at start, naming what is missing.

The trainer's own checkpoints (`train/`) are a separate schedule; nothing here is one.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights

BUCKET_BYTES = 256 << 20
"""Most tensor bytes in one `/update_weights_from_tensor` request (weight_transfer=tensor)."""
Named = list[tuple[str, Any]]


def write_weights(state_dict: dict[str, Any], model_path: Path, folder: Path) -> Path:
    """Write `state_dict` with `model_path`'s model files as the folder `folder`; returns `folder`."""
    _not_empty(state_dict)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    copy_model_files(model_path, partial)
    save_weights(state_dict, partial / WEIGHTS_FILE)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def tensor_buckets(state_dict: dict[str, Any], bucket_bytes: int = BUCKET_BYTES) -> Iterator[Named]:
    """`state_dict` as lists of `(name, CPU tensor)`, each at most `bucket_bytes` (a larger tensor goes alone)."""
    _not_empty(state_dict)
    bucket: Named = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to("cpu").contiguous()))
        size += nbytes
    yield bucket


def tensor_body(bucket: Named, tp_size: int, version: int | None, flush_cache: bool) -> dict[str, Any]:
    """The `/update_weights_from_tensor` body of one bucket, for a server of `tp_size` ranks; `version` (and the
    cache flush) only on the last bucket of an update."""
    data = base64.b64encode(pickle.dumps(bucket, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    body: dict[str, Any] = {"serialized_named_tensors": [data] * max(tp_size, 1),
                            "flush_cache": flush_cache and version is not None}
    if version is not None:
        body["weight_version"] = str(version)
    return body


async def tensor_bodies(state_dict: dict[str, Any], tp_size: int, version: int, flush_cache: bool,
                        bucket_bytes: int = BUCKET_BYTES) -> AsyncIterator[dict[str, Any]]:
    """The `/update_weights_from_tensor` bodies of one update, bucket by bucket (made off the event loop)."""
    buckets = tensor_buckets(state_dict, bucket_bytes)
    bucket: Named | None = await asyncio.to_thread(next, buckets)
    while bucket is not None:
        following = await asyncio.to_thread(next, buckets, None)
        yield await asyncio.to_thread(tensor_body, bucket, tp_size, None if following else version, flush_cache)
        bucket = following


def check_transfer(transfer: str) -> None:
    """Refuse `engine.weight_transfer=distributed` where it cannot run, saying what it needs."""
    if transfer != "distributed":
        return
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_available() or not dist.is_initialized():
        raise ValueError("engine.weight_transfer=distributed broadcasts the weights over NCCL from the trainer to "
                         "the servers: it needs CUDA and an initialised torch.distributed process group (a GPU "
                         "run launched with torchrun or DeepSpeed); this run has "
                         f"cuda={torch.cuda.is_available()}, process group="
                         f"{dist.is_available() and dist.is_initialized()}. Use engine.weight_transfer=tensor "
                         "(or disk)")
    raise ValueError("engine.weight_transfer=distributed (/init_weights_update_group + "
                     "/update_weights_from_distributed) is not built yet in this client; use "
                     "engine.weight_transfer=tensor (or disk)")


def _not_empty(state_dict: dict[str, Any]) -> None:
    if not state_dict:
        raise ValueError("update_weights got an empty state dict: nothing to load on the SGLang servers")
