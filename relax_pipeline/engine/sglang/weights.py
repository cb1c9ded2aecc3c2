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
- `distributed` (`DistributedWeights`): the trainer's process (rank 0) and every server's tensor-parallel ranks form
  one process group, made at the first update: `/init_weights_update_group {master_address, master_port,
  rank_offset, world_size, group_name, backend}` on every server (server i's ranks start at 1 + the ranks of the
  servers before it) while this process joins as rank 0 (`init_weight_group`: SGLang's own rendezvous, a TCP store
  this process hosts on `master_port`). Each update then sends, per bucket, `/update_weights_from_distributed
  {names, dtypes, shapes, group_name, flush_cache[, weight_version]}` to every server while rank 0 broadcasts the
  bucket's tensors in that order (the servers receive them into new tensors and load them); only the last bucket
  sets the version (and flushes). `close` sends `/destroy_weights_update_group`. The backend
  (`engine.weight_backend`) is nccl where CUDA is available, else gloo (the CPU tests: the fake server joins the
  group and receives the broadcast); `master_address` (`engine.weight_master_address`) defaults to the address
  this machine reaches the first server from. `check_transfer` refuses at start what cannot work, naming the key.

The trainer's own checkpoints (`train/`) are a separate schedule; nothing here is one.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relax_pipeline.engine.sglang.wire import SglangError
from relax_pipeline.infra.ports import free_port
from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights

log = logging.getLogger(__name__)

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


def tensor_buckets(state_dict: dict[str, Any], bucket_bytes: int = BUCKET_BYTES,
                   device: str = "cpu") -> Iterator[Named]:
    """`state_dict` as lists of `(name, tensor on device)`, each at most `bucket_bytes` (a larger tensor goes alone)."""
    _not_empty(state_dict)
    bucket: Named = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to(device).contiguous()))
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
    async for bucket, last in _buckets(state_dict, bucket_bytes, "cpu"):
        yield await asyncio.to_thread(tensor_body, bucket, tp_size, version if last else None, flush_cache)


async def _buckets(state_dict: dict[str, Any], bucket_bytes: int, device: str) -> AsyncIterator[tuple[Named, bool]]:
    """`tensor_buckets` made off the event loop, each with whether it is the update's last."""
    buckets = tensor_buckets(state_dict, bucket_bytes, device)
    bucket: Named | None = await asyncio.to_thread(next, buckets)
    while bucket is not None:
        following = await asyncio.to_thread(next, buckets, None)
        yield bucket, following is None
        bucket = following


GROUP_NAME = "relax_weight_update"
"""The weight-update group's name on the servers (`group_name`; SGLang's default is `weight_update_group`)."""
GROUP_TIMEOUT = timedelta(minutes=10)
"""How long a rank waits for the others to join the group, or for a broadcast to be received."""
Post = Callable[[str, str, dict[str, Any]], Awaitable[Any]]
"""POST `body` to `path` on the server at a URL, its JSON answer: `post(url, path, body)` (the engine's HTTP call)."""


def weight_backend(configured: str | None) -> str:
    """`engine.weight_backend`, resolved: as configured, else nccl where this process has CUDA, else gloo."""
    if configured is not None:
        return configured
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def check_transfer(transfer: str, backend: str | None = None) -> None:
    """Refuse `engine.weight_transfer=distributed` where it cannot run, naming the key and the fix."""
    if transfer != "distributed":
        return
    import torch
    import torch.distributed as dist

    resolved = weight_backend(backend)
    if not dist.is_available():
        raise ValueError("engine.weight_transfer=distributed needs torch.distributed, which this torch build lacks; "
                         "use engine.weight_transfer=tensor (or disk)")
    if resolved == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("engine.weight_backend=nccl broadcasts the weights from this process's GPU: it needs CUDA "
                         f"and torch built with NCCL here (cuda={torch.cuda.is_available()}); set "
                         "engine.weight_backend=gloo (through host memory) or engine.weight_transfer=tensor")
    if resolved == "gloo" and not dist.is_gloo_available():
        raise ValueError("engine.weight_backend=gloo: this torch build has no Gloo; set engine.weight_backend=nccl "
                         "(on a GPU) or engine.weight_transfer=tensor")


@dataclass(frozen=True)
class GroupPlan:
    """The weight-update group: where rank 0 listens, each server's first rank, its size and backend; connects the
    client to every server's `/init_weights_update_group`."""

    address: str
    port: int
    offsets: tuple[int, ...]
    world_size: int
    backend: str

    @classmethod
    def of(cls, urls: list[str], tp_sizes: list[int], backend: str, address: str | None) -> GroupPlan:
        """Rank 0 is this process; server i's tensor-parallel ranks follow the servers before it."""
        offsets, rank = [], 1
        for size in tp_sizes:
            offsets.append(rank)
            rank += max(size, 1)
        return cls(address or local_address(urls[0]), free_port("0.0.0.0"), tuple(offsets), rank, backend)

    def body(self, server: int) -> dict[str, Any]:
        return {"master_address": self.address, "master_port": self.port, "rank_offset": self.offsets[server],
                "world_size": self.world_size, "group_name": GROUP_NAME, "backend": self.backend}


def local_address(url: str) -> str:
    """The address of this machine that the server at `url` is reached from (no packet is sent)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    family, kind, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def init_weight_group(backend: str, address: str, port: int, world_size: int, rank: int,
                      group_name: str = GROUP_NAME, timeout: timedelta = GROUP_TIMEOUT) -> Any:
    """Join the weight-update group as `rank` (rank 0 hosts its TCP store on `port`). This is SGLang 0.5.23's
    `init_custom_process_group` (`sglang/srt/utils/common.py`), so both ends meet on the same store keys; like it,
    it uses torch's private `_new_process_group_helper`, so the group is not the default one (a DeepSpeed trainer's
    ranks keep theirs)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    host = f"[{address}]" if ":" in address else address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast(group: Any, bucket: Named) -> None:
    """Broadcast the bucket's tensors from rank 0, in order (the servers receive them in the same order)."""
    import torch.distributed as dist

    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in bucket]
    for handle in handles:
        handle.wait()


def distributed_body(bucket: Named, version: int | None, flush_cache: bool) -> dict[str, Any]:
    """The `/update_weights_from_distributed` body of one bucket; `version` (and the flush) on the last only."""
    body: dict[str, Any] = {"names": [name for name, _ in bucket],
                            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                            "shapes": [list(t.shape) for _, t in bucket], "group_name": GROUP_NAME,
                            "flush_cache": flush_cache and version is not None}
    if version is not None:
        body["weight_version"] = str(version)
    return body


class DistributedWeights:
    """engine.weight_transfer=distributed: rank 0 of one weight-update group with every server (see the module)."""

    def __init__(self, post: Post, backend: str | None, address: str | None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.post = post
        self.backend = weight_backend(backend)
        self.address = address
        """`engine.weight_master_address`; None: the address this machine reaches the first server from."""
        self.bucket_bytes = bucket_bytes
        self.group: Any = None
        self.urls: list[str] = []

    async def update(self, urls: list[str], tp_sizes: list[int], state_dict: dict[str, Any], version: int,
                     flush_cache: bool) -> None:
        """Load `state_dict` on every server as `version` (the group is made at the first update)."""
        if self.group is None:
            await self._connect(urls, tp_sizes)
        device = "cuda" if self.backend == "nccl" else "cpu"
        async for bucket, last in _buckets(state_dict, self.bucket_bytes, device):
            body = distributed_body(bucket, version if last else None, flush_cache)
            sent = [self.post(url, "/update_weights_from_distributed", body) for url in self.urls]
            *answers, _ = await asyncio.gather(*sent, _in_thread(broadcast, self.group, bucket))
            _succeeded("/update_weights_from_distributed", self.urls, answers)

    async def _connect(self, urls: list[str], tp_sizes: list[int]) -> None:
        plan = GroupPlan.of(urls, tp_sizes, self.backend, self.address)
        log.info("weight-update group: rank 0 at %s:%d, %d ranks, backend %s", plan.address, plan.port,
                 plan.world_size, plan.backend)
        joined = _in_thread(init_weight_group, plan.backend, plan.address, plan.port, plan.world_size, 0)
        sent = [self.post(url, "/init_weights_update_group", plan.body(i)) for i, url in enumerate(urls)]
        *answers, group = await asyncio.gather(*sent, joined)
        _succeeded("/init_weights_update_group", urls, answers)
        self.group, self.urls = group, list(urls)

    async def close(self) -> None:
        """Leave the group on every server (`/destroy_weights_update_group`) and here."""
        if self.group is None:
            return
        import torch.distributed as dist

        group, self.group = self.group, None
        try:
            await asyncio.gather(*(self.post(url, "/destroy_weights_update_group", {"group_name": GROUP_NAME})
                                   for url in self.urls), return_exceptions=True)
        finally:
            dist.destroy_process_group(group)


def _succeeded(path: str, urls: list[str], answers: list[Any]) -> None:
    for url, answer in zip(urls, answers, strict=True):
        if not (isinstance(answer, dict) and answer.get("success", False)):
            message = answer.get("message") if isinstance(answer, dict) else answer
            raise SglangError(f"SGLang server {url} refused {path}: {message}")


def _in_thread(function: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """Run `function(*args)` in a daemon thread: a rank waiting for a server that failed must not hold the process
    at exit (it gives up after `GROUP_TIMEOUT`), as a thread of the loop's executor would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as error:  # handed to the awaiting task
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name=f"weights-{function.__name__}", daemon=True).start()
    return future


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _not_empty(state_dict: dict[str, Any]) -> None:
    if not state_dict:
        raise ValueError("update_weights got an empty state dict: nothing to load on the SGLang servers")
