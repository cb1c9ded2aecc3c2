"""The SGLang-wire fake's side of `engine.weight_transfer=distributed`: a weight-update group, joined and received.

SGLang 0.5.23's three routes, with its bodies (`io_struct.py`) and answers (`http_server.py`), on the fake's
`FakeState` (`testing/sglang_server.py` holds only the route lines):

- `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}`:
  the fake (one tensor-parallel rank) joins the group as rank `rank_offset` through the client's own copy of
  SGLang's rendezvous (`engine.sglang_weights.init_weight_group`), so the store keys are SGLang's; the call answers
  once every rank joined.
- `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version}`: new
  tensors of those dtypes and shapes receive rank 0's broadcasts, in order (SGLang's
  `receive_weights_from_distributed`), and load as a (partial) state dict like `/update_weights_from_tensor`; only
  an update naming a `weight_version` changes the version served.
- `POST /destroy_weights_update_group {group_name}`: leaves the group.

As 0.5.23's `scheduler_components/weight_updater.py`: a distributed (or tensor) load outside a weight-update session
(`/begin_weight_update` ... `/end_weight_update`) is refused, and `flushed` flushes the cache after a load only
when the body's `flush_cache` asks (its default is true), failing the call when requests are running.

`unpickle` reads `/update_weights_from_tensor`'s tensors (SGLang's safe-unpickler globals only).

Not modelled: `load_format` (refused), `abort_all_requests`, more than one rank per server. The fake must run in its
own process (launched, as SGLang is): torch refuses two groups of one name in one process, so an in-process fake
beside the client answers `/init_weights_update_group` with that error.
"""

from __future__ import annotations

import asyncio
import base64
import io
import pickle
from collections.abc import Awaitable, Callable
from typing import Any
from weakref import WeakKeyDictionary

from fastapi.responses import JSONResponse, Response

from relax_pipeline.engine.sglang.weights import init_weight_group

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default `group_name`."""
Load = Callable[[Any, dict[str, Any], str, int], Awaitable[None]]
"""The fake's weight load: `load(state, weights, version, unnamed)` (`sglang_server._load`)."""
_GROUPS: WeakKeyDictionary[Any, dict[str, Any]] = WeakKeyDictionary()
"""Each fake's joined groups by name."""


def _groups(state: Any) -> dict[str, Any]:
    return _GROUPS.setdefault(state, {})


def answer(success: bool, message: str) -> Response:
    return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


async def init_group(state: Any, body: dict[str, Any]) -> Response:
    """Join the group as rank `rank_offset` (this fake's one rank); answers once every rank joined."""
    name = str(body.get("group_name") or DEFAULT_GROUP)
    try:
        group = await asyncio.to_thread(init_weight_group, str(body.get("backend") or "nccl"),
                                        str(body["master_address"]), int(body["master_port"]),
                                        int(body["world_size"]), int(body["rank_offset"]), name)
    except Exception as error:  # SGLang answers every failure as a message
        return answer(False, f"Failed to initialize custom process group: {error}.")
    _groups(state)[name] = group
    return answer(True, "Succeeded to initialize custom process group.")


def receive(group: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, Any]]:
    """Rank 0's broadcasts, in order, into new tensors of those dtypes and shapes."""
    import torch
    import torch.distributed as dist

    weights = [(name, torch.empty(shape, dtype=getattr(torch, dtype)))
               for name, dtype, shape in zip(names, dtypes, shapes, strict=True)]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in weights]
    for handle in handles:
        handle.wait()
    return weights


async def update_from_distributed(state: Any, body: dict[str, Any], load: Load) -> Response:
    """Receive the named tensors from rank 0 and load them; the version changes only when the body names one."""
    name = str(body.get("group_name") or DEFAULT_GROUP)
    group = _groups(state).get(name)
    if group is None:
        return answer(False, f"Group {name} not in {sorted(_groups(state))}. Please call "
                              "`init_weights_update_group` first.")
    if body.get("load_format") is not None:
        return answer(False, "this fake takes no load_format")
    if not state.update_session:  # scheduler_components/weight_updater.py refuses before receiving
        return answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                             "end_weight_update()")
    named = await asyncio.to_thread(receive, group, list(body["names"]), list(body["dtypes"]), list(body["shapes"]))
    version = body.get("weight_version")
    await load(state, dict(named), str(version or state.weight_version), state.engine.weight_version)
    if version is not None:
        state.weight_version = str(version)
    return answer(*flushed(state, body, "Succeeded to update parameter online."))


def flushed(state: Any, body: dict[str, Any], message: str) -> tuple[bool, str]:
    """SGLang's `flush_cache_after_weight_update` (`scheduler_components/weight_updater.py`): with `flush_cache`
    (true unless the body says false) the cache is flushed, and a flush refused because requests run fails the
    call (the weights stay loaded)."""
    if body.get("flush_cache", True) and not state.pool.flush():
        return False, ("Weights were updated, but the cache was not flushed because requests are still running or "
                       "queued. Retract or finish them, then call /flush_cache.")
    return True, message


async def destroy_group(state: Any, body: dict[str, Any]) -> Response:
    """Leave the group."""
    import torch.distributed as dist

    group = _groups(state).pop(str(body.get("group_name") or DEFAULT_GROUP), None)
    if group is None:
        return answer(False, "The group to be destroyed does not exist.")
    dist.destroy_process_group(group)
    return answer(True, "Succeeded to destroy custom process group.")


class _TensorUnpickler(pickle.Unpickler):
    """Only the globals a pickled `[(name, tensor), ...]` needs (each one SGLang's SafeUnpickler admits)."""

    ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"), ("torch", "Size")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            import torch

            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"blocked global {module}.{name} (SGLang's safe unpickler refuses it)")


def unpickle(data: str) -> list[tuple[str, Any]]:
    """`serialized_named_tensors[i]` of `/update_weights_from_tensor` (base64 of a pickled `[(name, tensor)]`),
    unpickled with only the globals SGLang's safe unpickler admits."""
    named = _TensorUnpickler(io.BytesIO(base64.b64decode(data, validate=True))).load()
    if not isinstance(named, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in named):
        raise ValueError("not a list of (name, tensor) pairs")
    return named
