"""A fake SGLang server: SGLang's native HTTP wire, backed by the embedded engine so tokens are real.

It follows the `http_server.py` and `io_struct.py` of the SGLang release `SGLANG_API_VERSION`
(engine/sglang/client.py) and serves exactly the routes `engine=sglang` calls, with exactly the body fields in
`ROUTES` (each one a field that release has: `tests/integration/test_sglang_conformance.py` reads them from its
wheel): `GET /health`, `GET /model_info`, `GET /server_info`, `POST /generate` (`input_ids` only, `return_logprob`,
`rid`, `session_params`, `image_data`), `POST /abort_request`, `POST /update_weights_from_disk`, `POST
/update_weights_from_tensor`, the weight-update group's three routes (`testing/sglang_weights_fake.py`), `POST
/pause_generation` (in place only), `POST /continue_generation`, `POST /open_session` and `POST /close_session`. Any
other path answers 404 and is recorded, so a test fails when the client calls a route this fake (and so the release
it follows) does not have; a body field or sampling parameter outside its table is refused (400) for the same reason
(SGLang itself ignores unknown top-level `/generate` fields: the fake is stricter). `GET /fake/stats` (not SGLang)
reports the calls, the unknown ones, the fields the client sent (`sent`), the open sessions and the peak of
concurrently running prompt + max_new_tokens (what KV admission bounds).

Behaviour as SGLang's, each from the release's file: a `/generate` of an aborted rid answers with the tokens and
logprobs generated so far and `finish_reason {"type": "abort"}`, an abort of an unknown rid is ignored, stop tokens
stay in `output_ids` (`managers/schedule_batch.py`, `FINISH_*.to_json`); `meta_info` carries `id`,
`finish_reason`, `prompt_tokens`, `weight_version`, `completion_tokens`, `cached_tokens` (the prompt's radix-cache
hit, sessions or not) and, with `return_logprob`, `output_token_logprobs` (`managers/tokenizer_manager.py`,
`_handle_batch_output`); `weight_version` starts as "default" and becomes the update's `weight_version`; a disk
update loads every `*.safetensors` of the folder; a tensor or distributed load is refused outside
`/begin_weight_update` ... `/end_weight_update`, and any load flushes the cache only when its `flush_cache` asks
(default true), failing while requests run (`scheduler_components/weight_updater.py`); while generation is paused
in place every decode step waits, an update loads between two of them, and a generation that spans updates
reports `meta_info.weight_versions` spans (`{version, start, end}`, `utils/weight_versions.py`). `cache_salt`
namespaces the prefix cache (`mem_cache/radix_cache.py`); `/server_info` reports `enable_session_radix_cache`
(`--enable-session-radix-cache`: open sessions reference their KV, `/close_session` dereferences it;
`testing/kv_pool.py`).

Sessions as SGLang's non-streaming sessions: `testing/sglang_sessions.py`.

Images as SGLang's: `image_data` (a list of URLs or `data:` URIs, one per image placeholder token of `input_ids`,
unexpanded) is processed by the wrapped engine's own `vision` and generated with, so the tokens are those the
embedded engine gives for that prompt and those images; `prompt_tokens` counts the expanded prompt. Not with
`session_params` (refused). `/update_weights_from_tensor` reads `serialized_named_tensors[0]` (tensor-parallel
rank 0: the fake has one) with an unpickler that admits only the globals a pickled list of `(name, tensor)` needs
(SGLang's own `SafeUnpickler` admits those and more), and loads them as a (partial) state dict; only an update
that names a `weight_version` changes the version served.

Options: `--decode-delay-s` sleeps before each forward pass so tests can abort a generation mid-way;
`--ignore-stop` generates to `max_new_tokens` whatever the stop tokens (exact lengths); `--kv-cache-mb 0`
turns the prefix cache off (a benchmark replaying the same prompts then meets no warmer cache than the
original run); `--max-total-num-tokens` is the KV capacity it reports and models (`testing/kv_pool.py`: requests
hold prompt + max_new_tokens while they run, idle KV is evicted least recently used, a turn whose KV was evicted
is counted as a re-prefill, a prefix served from KV older weights computed is counted as stale; `GET /fake/stats`
gives the `kv_*` counts, `GET /metrics` SGLang's `sglang:num_used_tokens` and `sglang:max_total_num_tokens`, as
SGLang serves them with `--enable-metrics`, a mount in `utils/common.py`, not a decorated route). Not SGLang:
logprobs follow the embedded engine's contract (full vocabulary at the sampling temperature), the tokens are
always computed by the current weights (what SGLang would serve from stale KV is counted, not computed), no
streaming or batch input, no streaming sessions, `/close_session` aborts the session's running turns (SGLang
lets them finish).

Run it as SGLang's launcher would be: `python -m relax_pipeline.testing.sglang_server --model-path M --host H
--port P [--decode-delay-s S] [--max-total-num-tokens N]` (unknown SGLang flags are accepted and ignored),
or in-process: `async with FakeSglangServer(model_path) as server: server.url`.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import logging
import pickle
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from relax_pipeline.canonical.form import image_of
from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.testing import sglang_weights_fake as weights_fake
from relax_pipeline.testing.kv_pool import KvPool
from relax_pipeline.testing.sglang_sessions import FakeSessions, Refused

log = logging.getLogger(__name__)
SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids",
                           "sampling_seed", "no_stop_trim", "skip_special_tokens"})
"""SGLang sampling parameters this fake understands; any other is refused."""
SESSION_KEYS = frozenset({"id", "rid", "offset", "replace"})
"""`session_params` fields this fake understands (not `drop_previous_output`); any other is refused."""
ROUTES: dict[tuple[str, str], frozenset[str]] = {
    ("GET", "/health"): frozenset(), ("GET", "/model_info"): frozenset(), ("GET", "/server_info"): frozenset(),
    ("POST", "/generate"): frozenset({"input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid",
                                      "stream", "session_params", "image_data", "cache_salt"}),
    ("POST", "/abort_request"): frozenset({"rid", "abort_all"}),
    ("POST", "/update_weights_from_disk"): frozenset({"model_path", "weight_version", "flush_cache"}),
    ("POST", "/update_weights_from_tensor"): frozenset({"serialized_named_tensors", "load_format", "flush_cache",
                                                        "weight_version"}),
    ("POST", "/pause_generation"): frozenset({"mode"}), ("POST", "/continue_generation"): frozenset(),
    ("POST", "/begin_weight_update"): frozenset({"selector"}), ("POST", "/end_weight_update"): frozenset(),
    ("POST", "/init_weights_update_group"): frozenset({"master_address", "master_port", "rank_offset", "world_size",
                                                       "group_name", "backend"}),
    ("POST", "/update_weights_from_distributed"): frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache",
                                                             "weight_version", "load_format"}),
    ("POST", "/destroy_weights_update_group"): frozenset({"group_name"}),
    ("POST", "/open_session"): frozenset({"capacity_of_str_len", "session_id", "timeout"}),
    ("POST", "/close_session"): frozenset({"session_id"})}
"""The SGLang routes this fake serves (exactly those the client uses) and the body fields each accepts."""
ROUTER_FIELDS = frozenset({"background", "log_metrics", "model", "no_logs", "return_bytes", "return_entropy",
                           "return_hidden_states", "return_text_in_logprobs"})
"""Top-level `/generate` fields smg 1.13.0 adds to what it forwards: accepted and ignored, as SGLang's
`/generate` ignores top-level fields it does not know (the fake refuses every other unknown one)."""


ROUTER_PROBES = frozenset({("GET", "/v1/models"), ("GET", "/version"), ("GET", "/loads"), ("GET", "/v1/loads")})
"""What smg 1.13.0 asks each worker on its own (model discovery, load polling): answered 404, not recorded as the
client's calls."""


class FakeState:
    """What the fake serves and records."""

    def __init__(self, engine: HFEngine, model_path: str, capacity: int, disabled: set[str],
                 ignore_stop: bool = False, session_radix_cache: bool = False) -> None:
        self.engine = engine
        self.ignore_stop = ignore_stop
        """Generate to max_new_tokens whatever stop tokens the request names (tests that need exact lengths)."""
        self.model_path = model_path
        self.capacity = capacity
        self.disabled = disabled
        """Paths answered 404 as if missing (tests of the client's error)."""
        self.weight_version = "default"
        self.calls: Counter[str] = Counter()
        self.unknown: list[str] = []
        self.sent: set[str] = set()
        """Every body field the client sent, as `METHOD /path field` (`sampling_params.top_p` for nested ones)."""
        self.live: set[str] = set()
        self.rids: list[str] = []
        """Every /generate rid, in arrival order (which worker served what)."""
        self.sessions = FakeSessions()
        self.running = threading.Event()
        """Cleared while generation is paused (`/pause_generation` in place): decode steps wait for it."""
        self.running.set()
        self.running_tokens = 0
        self.peak_tokens = 0
        self.session_radix_cache = session_radix_cache
        """`--enable-session-radix-cache`: open sessions reference their KV (`/server_info` reports it)."""
        self.pool = KvPool(capacity, session_refs=session_radix_cache)
        """The KV pool of `capacity` tokens: SGLang's radix cache as counts (`testing/kv_pool.py`)."""
        self.update_session = False
        """Between `/begin_weight_update` and `/end_weight_update` (tensor and distributed loads need it)."""

    def stats(self) -> dict[str, Any]:
        return self.pool.stats() | {"calls": dict(self.calls), "unknown": self.unknown, "peak_tokens": self.peak_tokens,
                "weight_version": self.weight_version, "rids": self.rids, "sent": sorted(self.sent),
                "sessions_open": sorted(self.sessions.open), "sessions_closed": self.sessions.closed}

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON body of `request`, its fields recorded; a field outside `ROUTES` is refused."""
        route = (request.method, request.url.path)
        body = await request.json() if await request.body() else {}
        if not isinstance(body, dict):
            raise Refused(f"{route[1]} takes a JSON object")
        ignored = ROUTER_FIELDS if route == ("POST", "/generate") else frozenset()
        for key, value in body.items():
            self.sent.add(f"{route[0]} {route[1]} {key}")
            if isinstance(value, dict) and key in ("sampling_params", "session_params"):
                self.sent.update(f"{route[0]} {route[1]} {key}.{inner}" for inner in value)
        unknown = sorted(set(body) - ROUTES[route] - ignored)
        if unknown:
            raise Refused(f"{route[1]}: unknown fields {unknown} (this fake follows the pinned SGLang release)")
        return body

    async def abort(self, rids: list[str]) -> None:
        for rid in rids:
            if rid in self.live:
                await self.engine.abort(rid)


def create_app(state: FakeState) -> FastAPI:
    """The fake's routes over `state`."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        key = (request.method, request.url.path)
        if request.url.path == "/fake/stats":
            return JSONResponse(state.stats())
        if key == ("GET", "/metrics"):  # SGLang's Prometheus metrics (--enable-metrics): a mount, not a route
            return Response(state.pool.prometheus(state.model_path), media_type="text/plain; version=0.0.4")
        if key in ROUTER_PROBES:  # smg asks every worker these; not the client's calls
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        state.calls[f"{key[0]} {key[1]}"] += 1
        if key not in ROUTES or key[1] in state.disabled:
            state.unknown.append(f"{key[0]} {key[1]}")
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        await state.abort(state.sessions.reap())
        return await call_next(request)

    @app.exception_handler(Refused)
    async def refused(request: Request, error: Refused) -> Response:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        from relax_pipeline.engine.sglang.client import SGLANG_API_VERSION

        return {"model_path": state.model_path, "max_total_num_tokens": state.capacity,
                "max_req_input_len": state.engine.max_context_len, "internal_states": [{}], "tp_size": 1,
                "enable_session_radix_cache": state.session_radix_cache, "version": SGLANG_API_VERSION}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _generate(state, await state.body(request))

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        body = await state.body(request)
        await state.abort(list(state.live) if body.get("abort_all") else [str(body.get("rid"))])
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> Response:
        return await _update(state, await state.body(request))

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request) -> Response:
        return await _update_from_tensor(state, await state.body(request))

    @app.post("/init_weights_update_group")
    async def init_weights_group(request: Request) -> Response:
        return await weights_fake.init_group(state, await state.body(request))

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> Response:
        return await weights_fake.update_from_distributed(state, await state.body(request), _load)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_group(request: Request) -> Response:
        return await weights_fake.destroy_group(state, await state.body(request))

    @app.post("/pause_generation")
    async def pause(request: Request) -> Response:
        mode = (await state.body(request)).get("mode", "abort")
        if mode != "in_place":
            raise Refused(f"this fake pauses in place only (mode {mode!r})")
        state.running.clear()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def resume(request: Request) -> Response:
        await state.body(request)
        state.running.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/begin_weight_update")
    async def begin_update(request: Request) -> Response:
        await state.body(request)
        if state.update_session:  # scheduler_components/weight_updater.py, begin_weight_update
            return weights_fake.answer(False, "a weight-update session is already open; call end_weight_update() "
                                              "first")
        state.update_session = True
        return weights_fake.answer(True, "Success")

    @app.post("/end_weight_update")
    async def end_update(request: Request) -> Response:
        await state.body(request)
        if not state.update_session:
            return weights_fake.answer(False, "no weight-update session is open; call begin_weight_update() first")
        state.update_session = False
        return weights_fake.answer(True, "Success")

    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        session_id = state.sessions.start(await state.body(request))
        state.pool.open_session(session_id)
        return JSONResponse(session_id)

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        session_id = str((await state.body(request)).get("session_id"))
        await state.abort(state.sessions.close(session_id))
        state.pool.close_session(session_id)  # dereferenced, not freed (session_ref_tracker.py)
        return Response(status_code=200)

    return app


async def _generate(state: FakeState, body: dict[str, Any]) -> Response:
    ids = body.get("input_ids")
    params = dict(body.get("sampling_params") or {})
    session = body.get("session_params")
    unknown = sorted(set(params) - SAMPLING_KEYS) + sorted(set(session or {}) - SESSION_KEYS)
    if not isinstance(ids, list) or unknown or body.get("stream") or (not ids and not session):
        why = f"unknown sampling or session params {unknown}" if unknown else "stream is not served" \
            if body.get("stream") else "input_ids (a non-empty list of token ids) is required; this fake takes no text"
        return JSONResponse({"error": {"message": why}}, status_code=400)
    rid = str(body.get("rid") or f"fake-{time.monotonic_ns()}")
    sampling = _sampling(params, state.ignore_stop)
    kept = 0
    try:
        media = _media(state, body.get("image_data"), session)
    except (Refused, ValueError) as error:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)
    if session:
        ids, kept, aborted = state.sessions.assemble(session, ids, rid, state.engine.tokenizer.bos_token_id)
        await state.abort(aborted)
    tokens = len(ids) + sampling.max_new_tokens
    session_id = str(session.get("id")) if session else None
    salt = body.get("cache_salt")
    held = await state.pool.acquire(session_id or rid, tuple(ids), sampling.max_new_tokens,
                                    str(salt) if salt else None, state.weight_version, session_id)
    kept = held.cached  # SGLang's cached_tokens: the prompt's radix-cache hit (a session only rebuilds the ids)
    state.live.add(rid)
    state.rids.append(rid)
    state.running_tokens += tokens
    state.peak_tokens = max(state.peak_tokens, state.running_tokens)
    output: list[int] = []
    try:
        result = await state.engine.generate(ids, sampling, rid, media=media)
        output = list(result.output_ids)
    except ValueError as error:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)
    finally:
        state.live.discard(rid)
        state.running_tokens -= tokens
        await state.pool.release(held, tuple(output))
        if session:
            state.sessions.finish(str(session.get("id")), rid, output)
    prompt_tokens = len(ids) + sum(m.tokens - 1 for m in media)
    return JSONResponse(_answer(state, rid, prompt_tokens, kept, result, bool(body.get("return_logprob"))))


def _media(state: FakeState, image_data: Any, session: Any) -> list[ImageFeatures]:
    """The processed images of `image_data` (SGLang's shapes for one request: a URL, or a list of them)."""
    if image_data is None:
        return []
    urls = [image_data] if isinstance(image_data, str) else image_data
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise Refused("image_data: this fake takes a URL or a list of URLs (data: URIs included)")
    if session:
        raise Refused("image_data with session_params: this fake serves images outside sessions only")
    vision = state.engine.vision
    if vision is None:
        raise Refused(f"image_data: the model {state.model_path} is text-only")
    return [vision.features(image_of(url, 0, f"image_data[{i}]")) for i, url in enumerate(urls)]


def _sampling(params: dict[str, Any], ignore_stop: bool = False) -> SamplingParams:
    stop = () if ignore_stop else params.get("stop") or ()
    stop_ids = () if ignore_stop else tuple(params.get("stop_token_ids") or ())
    return SamplingParams(int(params.get("max_new_tokens", 128)), float(params.get("temperature", 1.0)),
                          float(params.get("top_p", 1.0)), int(params.get("top_k", -1)),
                          (stop,) if isinstance(stop, str) else tuple(stop),
                          stop_ids, params.get("sampling_seed"))


def _answer(state: FakeState, rid: str, prompt_len: int, kept: int, result: GenerateResult,
            logprobs: bool) -> dict[str, Any]:
    ids = list(result.output_ids)
    finish: dict[str, Any] = {"type": result.finish_reason}
    if result.finish_reason == "stop":
        finish["matched"] = result.matched_stop if result.matched_stop is not None else (ids[-1] if ids else None)
    elif result.finish_reason == "length":
        finish["length"] = len(ids)
    else:
        finish["message"] = "Abort in running batch"
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len, "cached_tokens": kept,
                            "completion_tokens": len(ids), "weight_version": state.weight_version}
    if result.weight_versions:
        meta["weight_versions"] = _spans(result.token_versions)
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
    if logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, ids, strict=True)]
    return {"text": state.engine.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}


def _spans(versions: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per-token versions as SGLang's `meta_info.weight_versions` spans (`"default"` for version 0)."""
    spans: list[dict[str, Any]] = []
    for i, version in enumerate(versions):
        name = str(version) if version else "default"
        if spans and spans[-1]["version"] == name:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": name, "start": i, "end": i + 1})
    return spans


async def _update(state: FakeState, body: dict[str, Any]) -> Response:
    from safetensors.torch import load_file

    folder = Path(str(body.get("model_path", "")))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return JSONResponse({"success": False, "message": f"no *.safetensors in {folder}", "num_paused_requests": 0},
                            status_code=400)
    weights: dict[str, Any] = {}
    for file in files:
        weights.update(await asyncio.to_thread(load_file, str(file)))
    version = str(body.get("weight_version") or state.weight_version)
    await _load(state, weights, version, state.engine.weight_version + 1)
    success, message = weights_fake.flushed(state, body, "Succeeded to update model weights.")
    if success and body.get("weight_version") is not None:
        message += f" Weight version updated to {version}."
    return JSONResponse({"success": success, "message": message, "num_paused_requests": 0},
                        status_code=200 if success else 400)


async def _update_from_tensor(state: FakeState, body: dict[str, Any]) -> Response:
    payloads = body.get("serialized_named_tensors")
    if body.get("load_format") is not None or not isinstance(payloads, list) or not payloads:
        return JSONResponse({"success": False, "message": "serialized_named_tensors (a list of base64 strings, one "
                             "per TP rank) is required; this fake takes no load_format"}, status_code=400)
    try:
        named = await asyncio.to_thread(weights_fake.unpickle, str(payloads[0]))
    except (pickle.UnpicklingError, ValueError, binascii.Error) as error:
        return JSONResponse({"success": False, "message": f"serialized_named_tensors[0]: {error}"}, status_code=400)
    if not state.update_session:  # scheduler_components/weight_updater.py
        return weights_fake.answer(False, "update_weights_from_tensor must run between begin_weight_update() and "
                                          "end_weight_update()")
    version = body.get("weight_version")
    await _load(state, dict(named), str(version or state.weight_version), state.engine.weight_version)
    if version is not None:
        state.weight_version = str(version)
    return weights_fake.answer(*weights_fake.flushed(state, body, "Success"))


async def _load(state: FakeState, weights: dict[str, Any], version: str, unnamed: int) -> None:
    """Load `weights` into the engine as `version` (`unnamed`: the number when it is not one). The embedded engine
    drops its own prefix cache (the fake's tokens always come from the current weights); the modelled radix cache
    (`state.pool`) is flushed only when the body asks (`weights_fake.flushed`), as SGLang's."""
    number = int(version) if version.isdigit() else unnamed
    if state.running.is_set():
        await state.engine.update_weights(weights, number)
    else:  # paused: the engine's worker waits before its next forward pass, so load the weights from here
        await asyncio.to_thread(state.engine._scheduler.load_weights, weights, number)  # type: ignore[union-attr]
    state.weight_version = version


def _gated(engine: HFEngine, running: threading.Event) -> None:
    """Every forward pass of the engine's model waits while `running` is clear (generation paused)."""
    model = engine.model
    forward = model.forward

    def gated(*args: Any, **kwargs: Any) -> Any:
        running.wait()
        return forward(*args, **kwargs)

    model.forward = gated  # type: ignore[method-assign]


def _slow_down(engine: HFEngine, delay_s: float) -> None:
    """Sleep `delay_s` before every forward pass of the engine's model (in its worker thread)."""
    model = engine.model
    forward = model.forward

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return forward(*args, **kwargs)

    model.forward = slow  # type: ignore[method-assign]


class FakeSglangServer:
    """The fake on 127.0.0.1:<free port> in this event loop: `async with FakeSglangServer(path) as s: s.url`."""

    def __init__(self, model_path: str | Path, capacity: int = 65536, decode_delay_s: float = 0.0,
                 disabled: set[str] | None = None, seed: int = 0, host: str = "127.0.0.1", port: int = 0,
                 max_context_len: int = 4096, ignore_stop: bool = False, kv_cache_mb: int = 64,
                 session_radix_cache: bool = False) -> None:
        self.engine = HFEngine(HFEngineSettings(kv_cache_mb=kv_cache_mb),
                               EngineRun(str(model_path), seed=seed, max_context_len=max_context_len))
        self.state = FakeState(self.engine, str(model_path), capacity, set(disabled or ()), ignore_stop,
                               session_radix_cache)
        self.decode_delay_s = decode_delay_s
        self.server = GatewayServer(create_app(self.state), host=host, port=port, prefix="",
                                    allow_remote=True)  # binds where SGLang would (engine.host)

    @property
    def url(self) -> str:
        return self.server.base_url.rstrip("/")

    async def start(self) -> None:
        await self.engine.start()
        eos = self.engine.tokenizer.eos_token_id
        self.engine.default_stop_token_ids = (eos,) if isinstance(eos, int) and not self.state.ignore_stop else ()
        if self.decode_delay_s > 0:
            _slow_down(self.engine, self.decode_delay_s)
        _gated(self.engine, self.state.running)
        await self.server.start()

    async def stop(self) -> None:
        self.state.running.set()
        await self.server.stop()
        await self.engine.close()

    async def __aenter__(self) -> FakeSglangServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _serve(args: argparse.Namespace) -> None:
    server = FakeSglangServer(args.model_path, args.max_total_num_tokens, args.decode_delay_s, seed=args.random_seed,
                              host=args.host, port=args.port, max_context_len=args.context_length,
                              ignore_stop=args.ignore_stop, kv_cache_mb=args.kv_cache_mb,
                              session_radix_cache=args.enable_session_radix_cache)
    await server.start()
    log.info("fake SGLang server on %s", server.url)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake SGLang server (relax_pipeline tests)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--context-length", type=int, default=4096)
    parser.add_argument("--max-total-num-tokens", type=int, default=65536)
    parser.add_argument("--decode-delay-s", type=float, default=0.0)
    parser.add_argument("--ignore-stop", action="store_true", help="generate to max_new_tokens (exact lengths)")
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="the embedded engine's prefix cache; 0: off")
    parser.add_argument("--enable-session-radix-cache", action="store_true",
                        help="SGLang's flag: open sessions reference their KV; /server_info reports it")
    args, ignored = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ignored:
        log.info("ignoring SGLang flags this fake does not model: %s", " ".join(ignored))
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
