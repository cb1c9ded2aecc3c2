"""A fake SGLang server: SGLang's native HTTP wire, backed by the embedded engine so tokens are real.

It follows SGLang 0.5.3's `http_server.py` (`SGLANG_API_VERSION` in `engine/sglang.py`) and implements
exactly the endpoints `engine=sglang` calls: `GET /health`, `GET /get_model_info`, `GET /get_server_info`,
`POST /generate` (`input_ids` only, `return_logprob`, `rid`), `POST /abort_request` and
`POST /update_weights_from_disk`. Any other path answers 404 and is recorded, so a test fails when the
client calls an endpoint this fake (and so the API version it follows) does not have; unknown sampling
parameters are refused (400) for the same reason. `GET /fake/stats` (not SGLang) reports the calls, the
unknown ones and the peak of concurrently running prompt + max_new_tokens (what KV admission bounds).

Behaviour as SGLang's: a `/generate` of an aborted rid answers with the tokens and logprobs generated so
far and `finish_reason {"type": "abort"}`; an abort of an unknown rid is ignored; stop tokens stay in
`output_ids`; `weight_version` starts as "default" and becomes the update's `weight_version`; a weight
update loads every `*.safetensors` of the folder (and clears the prefix cache). `--decode-delay-s` sleeps
before each forward pass so tests can abort a generation mid-way; `--ignore-stop` generates to
`max_new_tokens` whatever the stop tokens (exact lengths); `--kv-cache-mb 0` turns the prefix cache off
(a benchmark replaying the same prompts then meets no warmer cache than the original run);
`--max-total-num-tokens` is the KV capacity it reports. Not SGLang: logprobs follow the embedded engine's
contract (full vocabulary at the sampling temperature), there is no radix cache eviction, streaming or batch
input.

Run it as SGLang's launcher would be: `python -m relax_pipeline.testing.sglang_server --model-path M --host H
--port P [--decode-delay-s S] [--max-total-num-tokens N]` (unknown SGLang flags are accepted and ignored),
or in-process: `async with FakeSglangServer(model_path) as server: server.url`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.hf import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.gateway.server import GatewayServer

log = logging.getLogger(__name__)
IMPLEMENTED = {("GET", "/health"), ("GET", "/get_model_info"), ("GET", "/get_server_info"), ("POST", "/generate"),
               ("POST", "/abort_request"), ("POST", "/update_weights_from_disk")}
"""The SGLang endpoints this fake serves (exactly those the client uses)."""
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed",
                 "no_stop_trim", "skip_special_tokens"}
"""SGLang sampling parameters this fake understands; any other is refused."""


class FakeState:
    """What the fake serves and records."""

    def __init__(self, engine: HFEngine, model_path: str, capacity: int, disabled: set[str],
                 ignore_stop: bool = False) -> None:
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
        self.live: set[str] = set()
        self.rids: list[str] = []
        """Every /generate rid, in arrival order (which worker served what)."""
        self.running_tokens = 0
        self.peak_tokens = 0

    def stats(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "unknown": self.unknown, "peak_tokens": self.peak_tokens,
                "weight_version": self.weight_version, "rids": self.rids}


def create_app(state: FakeState) -> FastAPI:
    """The fake's routes over `state`."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        key = (request.method, request.url.path)
        if request.url.path == "/fake/stats":
            return JSONResponse(state.stats())
        state.calls[f"{key[0]} {key[1]}"] += 1
        if key not in IMPLEMENTED or key[1] in state.disabled:
            state.unknown.append(f"{key[0]} {key[1]}")
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        from relax_pipeline.engine.sglang import SGLANG_API_VERSION

        return {"model_path": state.model_path, "max_total_num_tokens": state.capacity,
                "max_req_input_len": state.engine.max_context_len, "weight_version": state.weight_version,
                "internal_states": [{}], "version": SGLANG_API_VERSION}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _generate(state, await request.json())

    @app.post("/abort_request")
    async def abort(request: Request) -> Response:
        body = await request.json()
        rids = list(state.live) if body.get("abort_all") else [body.get("rid")]
        for rid in rids:
            if rid in state.live:
                await state.engine.abort(rid)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> Response:
        return await _update(state, await request.json())

    return app


async def _generate(state: FakeState, body: dict[str, Any]) -> Response:
    ids = body.get("input_ids")
    params = dict(body.get("sampling_params") or {})
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if not isinstance(ids, list) or not ids or unknown or body.get("stream"):
        why = f"unknown sampling params {unknown}" if unknown else "stream is not served" if body.get("stream") \
            else "input_ids (a non-empty list of token ids) is required; this fake takes no text"
        return JSONResponse({"error": {"message": why}}, status_code=400)
    rid = str(body.get("rid") or f"fake-{time.monotonic_ns()}")
    sampling = _sampling(params, state.ignore_stop)
    tokens = len(ids) + sampling.max_new_tokens
    state.live.add(rid)
    state.rids.append(rid)
    state.running_tokens += tokens
    state.peak_tokens = max(state.peak_tokens, state.running_tokens)
    try:
        result = await state.engine.generate(ids, sampling, rid)
    except ValueError as error:
        return JSONResponse({"error": {"message": str(error)}}, status_code=400)
    finally:
        state.live.discard(rid)
        state.running_tokens -= tokens
    return JSONResponse(_answer(state, rid, len(ids), result, bool(body.get("return_logprob"))))


def _sampling(params: dict[str, Any], ignore_stop: bool = False) -> SamplingParams:
    stop = () if ignore_stop else params.get("stop") or ()
    stop_ids = () if ignore_stop else tuple(params.get("stop_token_ids") or ())
    return SamplingParams(int(params.get("max_new_tokens", 128)), float(params.get("temperature", 1.0)),
                          float(params.get("top_p", 1.0)), int(params.get("top_k", -1)),
                          (stop,) if isinstance(stop, str) else tuple(stop),
                          stop_ids, params.get("sampling_seed"))


def _answer(state: FakeState, rid: str, prompt_len: int, result: GenerateResult, logprobs: bool) -> dict[str, Any]:
    ids = list(result.output_ids)
    finish: dict[str, Any] = {"type": result.finish_reason}
    if result.finish_reason == "stop":
        finish["matched"] = result.matched_stop if result.matched_stop is not None else (ids[-1] if ids else None)
    elif result.finish_reason == "length":
        finish["length"] = len(ids)
    else:
        finish["message"] = "Abort in running batch"
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": state.weight_version}
    if logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, ids, strict=True)]
    return {"text": state.engine.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}


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
    await state.engine.update_weights(weights, int(version) if version.isdigit() else state.engine.weight_version + 1)
    state.weight_version = version
    return JSONResponse({"success": True, "message": f"Succeeded to update model weights. Weight version updated to "
                         f"{version}.", "num_paused_requests": 0})


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
                 max_context_len: int = 4096, ignore_stop: bool = False, kv_cache_mb: int = 64) -> None:
        self.engine = HFEngine(HFEngineSettings(kv_cache_mb=kv_cache_mb),
                               EngineRun(str(model_path), seed=seed, max_context_len=max_context_len))
        self.state = FakeState(self.engine, str(model_path), capacity, set(disabled or ()), ignore_stop)
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
        await self.server.start()

    async def stop(self) -> None:
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
                              ignore_stop=args.ignore_stop, kv_cache_mb=args.kv_cache_mb)
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
