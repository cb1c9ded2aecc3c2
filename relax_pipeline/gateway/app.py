"""The gateway's ASGI app: model-API routes per session, auth, `/health` and `/v1/models`.

Every front-end resource is served under the service prefix in both forms, `{prefix}/v1/<resource>`
and `{prefix}/<resource>` (the OpenAI SDKs append the bare resource to a base URL that keeps its path).
`Authorization: Bearer <credential>` (or `x-api-key`) selects the session. The credential is the session's
`RELAX_API_KEY`, a random secret separate from the session id; on a loopback gateway (`session_ids=True`,
what the run passes when `gateway.allow_remote=false`) the session's own `RELAX_SESSION_ID` also opens it
(docs/design.md §3.3), while a gateway other hosts can reach takes keys only (the id is logged, so it is no secret).
Missing or unknown → 401, a session that is not running (not started, finished, failed, dropped) → 404,
each before the body is read. A credential opens only its own session: a request can only read and write
that session's forest and continue from that session's response ids. Bodies are parsed with
`orjson.loads` on the raw bytes (no pydantic on the hot path); errors are shaped per protocol. JSON and
Buffered SSE share one path up to rendering. Every model request writes one access line
(`relax_pipeline.gateway.access`: api, session, status, tokens, ms) to run.log, and every 4xx/5xx is a
WARNING with its message. Each answer's id is recorded against the response node it committed
(`ForestStore.remember_response`), for Responses' `previous_response_id`. The OpenAPI document of the
served routes is `openapi.py`'s, at `GET {prefix}/openapi.json`. This module does not start a server
(`server.py`) and holds no turn logic (`turn/service.py`).

A client that disconnects: a turn is committed when its generation ends, and the forest only grows, so
what counts is whether the disconnect came first. Noticed during generation (JSON or SSE, heartbeats
included), the generation is aborted, nothing is committed and the access line says 499. Once generation
has ended the turn is committed even if the client then leaves before reading the terminal frames: the
agent's next request replays its own history, which either continues that response or branches before it
(a recorded fork, and the unseen response stays a leaf of its own chain). The turn is then in the forest
like any other: we do not know whether the client read it, only that the engine produced it.

Model turns are served as raw ASGI routes, the gateway's one hot path: `GatewayApp` sends a POST on one of
the exact model paths straight to its `TurnRoute` and everything else (health, models, count_tokens, unknown
routes, wrong methods, trailing slashes) to the FastAPI app, where the same routes are also registered, so
every answer the FastAPI app gives is given either way. Repeated slashes in a path (a base URL ending in `/`
joined with `/chat/completions`) are read as one. `DisconnectWatch` cancels a turn when its client goes away;
`json_response` renders with orjson (compact UTF-8, as Starlette's JSONResponse writes it), and `JsonReply` sends
a turn's answer as the same head and body; an access line goes straight into run.log's buffer where run.log alone
would take it (`tracking.logs.write_info`), else through `logging`. What each of these costs a request is measured
by `bench/gateway.py` (docs/benchmarks.md, "Gateway").
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from relax_pipeline.canonical.form import CanonicalError
from relax_pipeline.gateway.openapi import openapi_document
from relax_pipeline.protocol.base import Frontend, ProtocolError, TurnMeta, anthropic_body, openai_body
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend, count_tokens
from relax_pipeline.protocol.suite import ProtocolSuite
from relax_pipeline.tracking.logs import ACCESS_LOGGER, write_info
from relax_pipeline.turn.records import TurnRequest, TurnResult
from relax_pipeline.turn.service import PreparedTurn, TurnService
from relax_pipeline.turn.sessions import ForestStore, Session, Status

log = logging.getLogger(__name__)
access_log = logging.getLogger(ACCESS_LOGGER)
_IDS = random.Random(secrets.randbits(64))
"""Response ids: unique, not secret (a credential opens only its own session's responses), so no system call each."""
ACCESS_LINE = "api=%s session=%s status=%d stream=%s prompt_tokens=%d completion_tokens=%d ms=%.1f"


def suite_app(store: ForestStore, turns: TurnService, suite: ProtocolSuite, model_name: str,
              session_ids: bool = False) -> GatewayApp:
    """The app a run serves: the `protocol` node's record taken whole (its front-ends, service prefix and SSE
    heartbeat); `session_ids` as in `create_app`."""
    return create_app(store, turns, suite.service_prefix, model_name, suite.frontends(), suite.sse_heartbeat_s,
                      session_ids=session_ids)


def create_app(store: ForestStore, turns: TurnService, prefix: str = "/agentic_api", model_name: str = "relax",
               frontends: Sequence[Frontend] | None = None, heartbeat_s: float = 15.0,
               session_ids: bool = False) -> GatewayApp:
    """Build the app; `prefix` is the service path that agents' base URLs keep; `session_ids`: a session's id
    also authenticates it (only for a loopback bind, `gateway.allow_remote=false`)."""
    app = FastAPI(title="relax_pipeline gateway", docs_url=None, redoc_url=None, openapi_url=None)
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    gateway = _Gateway(store, turns, model_name, heartbeat_s, session_ids)
    served = list(frontends or [ChatFrontend()])
    app.add_api_route("/health", gateway.health, methods=["GET"])
    turn_routes: dict[str, TurnRoute] = {}
    for base in (f"{prefix}/v1", prefix):
        for frontend in served:
            for path in frontend.paths:
                turn_routes[f"{base}/{path}"] = TurnRoute(partial(gateway.turn, frontend))
                app.router.routes.append(Route(f"{base}/{path}", turn_routes[f"{base}/{path}"], methods=["POST"]))
            if isinstance(frontend, MessagesFrontend):
                app.add_api_route(f"{base}/messages/count_tokens", gateway.count_tokens, methods=["POST"])
        app.add_api_route(f"{base}/models", gateway.models, methods=["GET"])
    document = openapi_document(prefix, [frontend.name for frontend in served])
    app.add_api_route(f"{prefix}/openapi.json", partial(_openapi, document), methods=["GET"])
    resources = ", ".join(p for f in served for p in f.paths)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler(resources))
    return GatewayApp(app, turn_routes)


async def _openapi(document: dict[str, Any]) -> Response:
    """The OpenAPI document of the served routes (no credential needed)."""
    return json_response(document)


def _http_error_handler(resources: str):  # noqa: ANN202 - a Starlette exception handler
    async def handle(request: Request, error: Exception) -> Response:
        """Unknown routes and wrong methods answer in the OpenAI error shape too (a 405 keeps its `Allow`)."""
        status = getattr(error, "status_code", 500)
        message = f"{request.method} {request.url.path}: {getattr(error, 'detail', 'error')}"
        if status == 404:
            message += f"; this gateway serves {resources} and models"
        access_log.warning("%s %s status=%d error=%s", request.method, request.url.path, status, message)
        return json_response(openai_body(ProtocolError(status, message)), status, getattr(error, "headers", None))

    return handle


class _Gateway:
    """Route handlers bound to the shared store and turn service."""

    def __init__(self, store: ForestStore, turns: TurnService, model_name: str, heartbeat_s: float,
                 session_ids: bool = False) -> None:
        self.store = store
        self.session_ids = session_ids
        """A session id also opens its own session (a loopback gateway)."""
        self.turns = turns
        self.model_name = model_name
        self.heartbeat_s = heartbeat_s
        self.tokenizer = turns.template.tokenizer

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "weight_version": self.turns.engine.weight_version}

    async def models(self, request: Request) -> Response:
        try:
            self._session(request.scope)
        except ProtocolError as error:
            return json_response(openai_body(error), error.status)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relax_pipeline"}
        return json_response({"object": "list", "data": [model]})

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic `messages/count_tokens`: input tokens of the rendered prompt, nothing generated."""
        try:
            self._session(request.scope)
            return json_response(count_tokens(_json(await request.body()), self.turns.template))
        except CanonicalError as error:
            return json_response(anthropic_body(ProtocolError.from_canonical(error)), 400)
        except ProtocolError as error:
            return json_response(anthropic_body(error), error.status)

    async def turn(self, frontend: Frontend, scope: Scope, receive: Receive) -> ASGIApp:
        """Authenticate, parse and match, then answer as JSON or Buffered SSE; every error in protocol shape.

        The prompt is matched and its length checked before any stream opens, so a request over the
        context limit gets a 400 in the provider's shape, never a 200 with an in-stream error."""
        started, session, body = time.perf_counter(), None, None
        try:
            session = self._session(scope)
            body = _json(await read_body(receive))
            turn = frontend.parse(body, session.memo, partial(self.store.response_history, session))
            stream = _wants_stream(body)
            prepared = self._prepare(session, turn)
        except (CanonicalError, ProtocolError) as error:
            return self._refuse(frontend, _protocol_error(error), session, started, _asked_stream(body))
        meta = self._meta(body, frontend)
        if stream:
            events = self._sse(frontend, session, prepared, meta, started)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            result = await self._generate(session, prepared, receive)
            self.store.remember_response(session, meta.response_id, result.node_id)
        except ProtocolError as error:
            return self._refuse(frontend, error, session, started)
        _access(frontend.name, session.id, 200, started, result)
        return JsonReply(frontend.render(result, meta))

    def _prepare(self, session: Session, turn: TurnRequest) -> PreparedTurn:
        """Match the request and build its prompt (400s: bad media, context too long) without generating."""
        return self.turns.prepare(session.forest, turn, session.turn_seed(), session.mode)

    def _refuse(self, frontend: Frontend, error: ProtocolError, session: Session | None, started: float,
                streamed: bool = False) -> JsonReply:
        _access(frontend.name, session.id if session else None, error.status, started, error=error, streamed=streamed)
        return JsonReply(frontend.error_body(error), error.status)

    def _meta(self, body: Any, frontend: Frontend) -> TurnMeta:
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        token_text = self._token_text if body.get("logprobs") is True else None
        return TurnMeta(f"{frontend.name}-{_IDS.getrandbits(96):024x}", int(time.time()), model, token_text)

    async def _generate(self, session: Session, prepared: PreparedTurn, receive: Receive) -> TurnResult:
        """Run the turn in this task; abort it (499, nothing committed) when the client goes away first."""
        task = asyncio.current_task()
        assert task is not None
        watch = DisconnectWatch(task, receive)
        try:
            return await self._run(session, prepared)
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            task.uncancel()
            raise ProtocolError(499, "client disconnected; the generation was aborted and nothing committed") from None
        finally:
            watch.stop()

    async def _run(self, session: Session, prepared: PreparedTurn) -> TurnResult:
        try:
            return await self.store.serving(session, self.turns.run_prepared(session.forest, prepared, session=session))
        except (ProtocolError, asyncio.CancelledError):
            raise
        except CanonicalError as error:
            raise ProtocolError.from_canonical(error) from None
        except Exception as error:  # noqa: BLE001 - every failure answers in protocol shape
            log.exception("turn failed")
            session.mark("turn_failed")  # the session's outcome is then infra_error (stages/runtime.py)
            raise ProtocolError(500, f"internal error: {type(error).__name__}: {error}") from None

    async def _sse(self, frontend: Frontend, session: Session, prepared: PreparedTurn, meta: TurnMeta,
                   started: float) -> AsyncIterator[bytes]:
        """Open frames at once, heartbeats while generating, then the whole terminal sequence.

        When the client disconnects, Starlette cancels this generator; the turn task is cancelled with it,
        which aborts the engine's generation, and nothing is committed.
        """
        task = asyncio.ensure_future(self._run(session, prepared))
        try:
            for frame in frontend.stream_open(meta):
                yield frame.encode()
            while not task.done():
                await asyncio.wait({task}, timeout=self.heartbeat_s)
                if not task.done():
                    yield frontend.heartbeat().encode()
            result = task.result()
            self.store.remember_response(session, meta.response_id, result.node_id)
            frames = frontend.stream_result(result, meta)
            _access(frontend.name, session.id, 200, started, result, streamed=True)
        except ProtocolError as error:
            frames = frontend.stream_error(error, meta)
            _access(frontend.name, session.id, error.status, started, error=error, streamed=True)
        finally:
            if not task.done():
                task.cancel()
                _access(frontend.name, session.id, 499, started, error=ProtocolError(499, "client disconnected"),
                        streamed=True)
        for frame in frames:
            yield frame.encode()

    def _token_text(self, token_id: int) -> str:
        return self.turns.template.decode([token_id])

    def _session(self, scope: Scope) -> Session:
        """Authenticate: Bearer token (or x-api-key) must name a session that is running."""
        key = _credential(scope)
        if not key:
            raise ProtocolError(401, "missing credential: send 'Authorization: Bearer <RELAX_API_KEY>'")
        session = self.store.authenticate(key, self.session_ids)
        if session is None and (released := self.store.released(key, self.session_ids)) is not None:
            raise ProtocolError(404, f"session {released[0]} is {released[1].value}; it takes no more requests")
        if session is None and self.store.get(key) is not None:
            raise ProtocolError(401, "a session id is a credential only on a loopback gateway "
                                     "(gateway.allow_remote=false): send the session's key, RELAX_API_KEY")
        if session is None:
            raise ProtocolError(401, "unknown credential: send the RELAX_API_KEY given to this agent")
        if session.status is Status.CREATED:
            raise ProtocolError(404, f"session {session.id} has not started yet")
        if not session.status.serving:
            raise ProtocolError(404, f"session {session.id} is {session.status.value}; it takes no more requests")
        return session


def _credential(scope: Scope) -> str | None:
    auth = header(scope, b"authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return header(scope, b"x-api-key") or None


def _json(raw: bytes | None) -> Any:
    if raw is None:
        raise ProtocolError(499, "client disconnected before its request body arrived")
    try:
        return orjson.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ProtocolError(400, f"the request body is not valid JSON: {error}") from None


def _wants_stream(body: Any) -> bool:
    """The `stream` field of a parsed body as a boolean; anything but true/false/absent is a 400 naming it."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ProtocolError(400, f"stream must be a boolean, got {stream!r}", "stream")
    return bool(stream)


def _asked_stream(body: Any) -> bool:
    """Whether a body that was refused asked for SSE (for its access line)."""
    return isinstance(body, dict) and body.get("stream") is True


def _protocol_error(error: CanonicalError | ProtocolError) -> ProtocolError:
    return ProtocolError.from_canonical(error) if isinstance(error, CanonicalError) else error


def _access(api: str, session_id: str | None, status: int, started: float, result: TurnResult | None = None,
            error: ProtocolError | None = None, streamed: bool = False) -> None:
    """One access line per model request in run.log; 4xx/5xx at WARNING with the error's message."""
    level = logging.INFO if error is None else logging.WARNING
    if not access_log.isEnabledFor(level):
        return
    ms = (time.perf_counter() - started) * 1000
    prompt, completion = (result.prompt_tokens, len(result.output.output_ids)) if result else (0, 0)
    fields = (api, session_id or "-", status, "true" if streamed else "false", prompt, completion, ms)
    if error is None:
        if write_info(access_log, ACCESS_LINE % fields):  # run.log alone would take it: straight into its buffer
            return
        line, values = ACCESS_LINE, fields
    else:
        line, values = ACCESS_LINE + " error=%s%s", (*fields, f"{error.param}: " if error.param else "", error.message)
    # the record `access_log.info` makes, without looking up its caller's frame (it is always this function)
    access_log.handle(access_log.makeRecord(access_log.name, level, __file__, _ACCESS_LINENO, line, values, None,
                                            "_access"))


_ACCESS_LINENO = _access.__code__.co_firstlineno


# --- raw ASGI pieces under the model routes ------------------------------------------------------

TurnHandler = Callable[[Scope, Receive], Awaitable[ASGIApp]]


class GatewayApp:
    """The ASGI entry point: model turns by exact path, everything else through `fallback`."""

    def __init__(self, fallback: ASGIApp, routes: Mapping[str, TurnRoute]) -> None:
        self.fallback = fallback
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if "//" in scope.get("path", ""):  # a base URL ending in "/" joined with "/chat/completions"
            scope = {**scope, "path": _single_slashes(scope["path"])}
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        await (route or self.fallback)(scope, receive, send)


def _single_slashes(path: str) -> str:
    while "//" in path:
        path = path.replace("//", "/")
    return path


class TurnRoute:
    """One model path as a plain ASGI app (Starlette mounts an object like this without wrapping it)."""

    def __init__(self, handle: TurnHandler) -> None:
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handle(scope, receive)
        await response(scope, receive, send)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a (lower-case) request header, as Starlette's `Headers.get` reads it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class DisconnectWatch:
    """Cancels `task` if the client disconnects before `stop()`; `fired` tells whether it did.

    After the body, the next message `receive` gives is the disconnect, so one waiter task suffices. It is
    started on the loop's next iteration, so a turn that finishes without waiting (an engine that answers
    at once) costs one cancelled callback instead of a task.
    """

    def __init__(self, task: asyncio.Task[Any], receive: Receive) -> None:
        self.task = task
        self.fired = False
        self._receive = receive
        self._waiter: asyncio.Future[Any] | None = None
        self._start = asyncio.get_running_loop().call_soon(self._wait)

    def _wait(self) -> None:
        self._waiter = asyncio.ensure_future(self._receive())
        self._waiter.add_done_callback(self._done)

    def _done(self, waiter: asyncio.Future[Any]) -> None:
        if waiter.cancelled() or waiter.exception() is not None or self._start.cancelled():
            return
        if waiter.result()["type"] == "http.disconnect":
            self.fired = True
            self.task.cancel()

    def stop(self) -> None:
        self._start.cancel()
        if self._waiter is not None:
            self._waiter.cancel()


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """`body` as compact UTF-8 JSON (`json_bytes`) in a Starlette `Response` (for the FastAPI routes)."""
    return Response(json_bytes(body), status_code=status, media_type="application/json", headers=headers)


def json_bytes(body: Any) -> bytes:
    """`body` as compact UTF-8 JSON (orjson; the standard library for what orjson refuses)."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError: big ints, non-string keys
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class JsonReply:
    """A model turn's JSON answer as a plain ASGI app: the head and body Starlette's `json_response` sends (the same
    two headers, in its order), without building a `Response` per turn."""

    __slots__ = ("payload", "status")

    def __init__(self, body: Any, status: int = 200) -> None:
        self.payload = json_bytes(body)
        self.status = status

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"%d" % len(self.payload)), (b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.payload})
