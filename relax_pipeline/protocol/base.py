"""The front-end contract: one model API as parse → canonical turn → render, for JSON and Buffered SSE.

Every API the gateway serves (Chat Completions, Responses, Messages) is a `Frontend`. The gateway owns
everything between parsing and rendering (auth, the turn, abort on disconnect, heartbeats), so JSON and
SSE share one code path up to rendering. Buffered SSE means: `stream_open` frames at once, a
`heartbeat` frame every `protocol.sse_heartbeat_s` while the engine generates, then the complete terminal
sequence from `stream_result` (or `stream_error`). Nothing is streamed token by token.
Every committed response's id names its response node in the session (the gateway records it), so a
request may continue from an earlier response by id (`Lineage`) instead of replaying the history.

Errors: handlers raise `ProtocolError` (or let a `CanonicalError` from canonicalization through); each
front-end renders it in its provider's shape, the OpenAI `{"error": {"message", "type", "param", "code"}}`
(`openai_body`) or the Anthropic `{"type": "error", "error": {"type", "message"}}` (`anthropic_body`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from relax_pipeline.canonical.form import Message
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.turn.errors import ProtocolError
from relax_pipeline.turn.records import TurnRequest, TurnResult

TokenText = Callable[[int], str]
Lineage = Callable[[str], tuple[Message, ...] | None]
"""The conversation a session's earlier response ended, by the response's id; None for an unknown id."""


@dataclass(frozen=True)
class TurnMeta:
    """Identity of one response, shared by its JSON body and all its SSE frames."""

    response_id: str
    created: int
    model: str
    token_text: TokenText | None = None
    """Set when the client asked for logprobs (decodes one token id)."""


@dataclass(frozen=True)
class SSEFrame:
    """One server-sent event: an optional `event:` name and a `data:` payload (JSON or a literal)."""

    data: Any
    event: str | None = None
    comment: bool = False

    def encode(self) -> bytes:
        if self.comment:
            return f": {self.data}\n\n".encode()
        data = self.data if isinstance(self.data, str) else json.dumps(self.data, ensure_ascii=False)
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {data}\n\n".encode()


class Frontend(Protocol):
    """One model API. Whether a request asked for SSE is the gateway's to read (the `stream` field, the same
    in every API)."""

    name: str
    paths: tuple[str, ...]
    """Resources it serves below `{prefix}/v1/` and `{prefix}/` (for example `chat/completions`)."""

    def parse(self, body: Any, memo: RequestMemo, lineage: Lineage | None = None) -> TurnRequest:
        """Validate and canonicalize; raise CanonicalError/ProtocolError with the field path. `lineage` reads
        the session's earlier responses by id (an API whose requests may continue a stored response, as
        Responses' `previous_response_id` does; the others ignore it)."""

    def render(self, result: TurnResult, meta: TurnMeta) -> dict[str, Any]:
        """The JSON response body."""

    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        """The protocol's error shape."""

    def stream_open(self, meta: TurnMeta) -> list[SSEFrame]:
        """Frames sent as soon as the stream opens."""

    def heartbeat(self) -> SSEFrame:
        """A frame that keeps the connection alive while generating."""

    def stream_result(self, result: TurnResult, meta: TurnMeta) -> list[SSEFrame]:
        """The whole terminal sequence for a finished turn."""

    def stream_error(self, error: ProtocolError, meta: TurnMeta) -> list[SSEFrame]:
        """The terminal sequence for a turn that failed after the stream opened."""


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    499: "client_closed_request",
    500: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    499: "invalid_request_error",
    500: "api_error",
}


def openai_body(error: ProtocolError) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_body(error: ProtocolError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = f"{error.param}: {error.message}" if error.param else error.message
    return {"type": "error", "error": {"type": kind, "message": message}}
