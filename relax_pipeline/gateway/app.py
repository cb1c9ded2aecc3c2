"""The gateway's FastAPI app: model-API routes per session, auth, `/health` and `/v1/models`.

Every route is served under the service prefix in both forms, `{prefix}/v1/<resource>` and
`{prefix}/<resource>` (the OpenAI SDKs append the bare resource to a base URL that keeps its path).
`Authorization: Bearer <session id>` selects the session: missing or unknown → 401, a session that is
not running (finished, failed, dropped) → 404. A request can only read and write its own session's
forest. Bodies are parsed with `orjson.loads` on the raw bytes (no pydantic on the hot path); errors are
shaped per protocol. This module does not start a server (`server.py`) and holds no turn logic
(`turn.py`).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from relax_pipeline.forest.canonical import CanonicalError
from relax_pipeline.forest.sessions import ForestStore, Session, Status
from relax_pipeline.gateway.turn import TurnService
from relax_pipeline.protocol import chat
from relax_pipeline.protocol.errors import ProtocolError, openai_body

log = logging.getLogger(__name__)


def create_app(
    store: ForestStore, turns: TurnService, prefix: str = "/agentic_api", model_name: str = "relax"
) -> FastAPI:
    """Build the app; `prefix` is the service path that agents' base URLs keep."""
    app = FastAPI(title="relax_pipeline gateway", docs_url=None, redoc_url=None, openapi_url=None)
    prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
    gateway = _Gateway(store, turns, model_name)
    app.add_api_route("/health", gateway.health, methods=["GET"])
    for base in (f"{prefix}/v1", prefix):
        app.add_api_route(f"{base}/chat/completions", gateway.chat, methods=["POST"])
        app.add_api_route(f"{base}/models", gateway.models, methods=["GET"])
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


async def _http_error(request: Request, error: Exception) -> Response:
    """Unknown routes and wrong methods answer in the OpenAI error shape too."""
    status = getattr(error, "status_code", 500)
    detail = getattr(error, "detail", "error")
    message = f"{request.method} {request.url.path}: {detail}"
    if status == 404:
        message += "; this gateway serves chat/completions and models (Responses and Messages land later)"
    return JSONResponse(openai_body(ProtocolError(status, message)), status_code=status)


class _Gateway:
    """Route handlers bound to the shared store and turn service."""

    def __init__(self, store: ForestStore, turns: TurnService, model_name: str) -> None:
        self.store = store
        self.turns = turns
        self.model_name = model_name
        self.tokenizer = turns.template.tokenizer

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "weight_version": self.turns.engine.weight_version}

    async def models(self, request: Request) -> Response:
        try:
            self._session(request)
        except ProtocolError as error:
            return _error(error)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relax_pipeline"}
        return JSONResponse({"object": "list", "data": [model]})

    async def chat(self, request: Request) -> Response:
        try:
            session = self._session(request)
            body = _json(await request.body())
            return await self._chat_turn(session, body)
        except CanonicalError as error:
            return _error(ProtocolError.from_canonical(error))
        except ProtocolError as error:
            return _error(error)
        except Exception as error:  # noqa: BLE001 - every failure answers in protocol shape
            log.exception("chat turn failed")
            return _error(ProtocolError(500, f"internal error: {type(error).__name__}: {error}"))

    async def _chat_turn(self, session: Session, body: Any) -> Response:
        turn = chat.parse_request(body, session.memo)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise ProtocolError(400, f"stream must be a boolean, got {stream!r}", "stream")
        if stream:
            raise ProtocolError(400, "stream=true is not supported yet; send stream=false", "stream")
        session.in_flight += 1
        try:
            result = await self.turns.run(session.forest, turn, seed=session.turn_seed())
        finally:
            session.in_flight -= 1
        token_text = self._token_text if body.get("logprobs") else None
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        return JSONResponse(chat.render_response(result, model, "chatcmpl-" + secrets.token_hex(12), token_text))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _session(self, request: Request) -> Session:
        """Authenticate: Bearer token (or x-api-key) must name a session that is running."""
        key = _credential(request)
        if not key:
            raise ProtocolError(401, "missing credential: send 'Authorization: Bearer <RELAX_SESSION_ID>'")
        session = self.store.get(key)
        if session is None:
            raise ProtocolError(401, "unknown credential: use the RELAX_SESSION_ID given to this agent")
        if session.status is Status.CREATED:
            raise ProtocolError(404, f"session {session.id} has not started yet")
        if not session.status.serving:
            raise ProtocolError(404, f"session {session.id} is {session.status.value}; it takes no more requests")
        return session


def _credential(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ProtocolError(400, f"the request body is not valid JSON: {error}") from None


def _error(error: ProtocolError) -> JSONResponse:
    return JSONResponse(openai_body(error), status_code=error.status)
