"""The front-end contract: one model API as parse → canonical turn → render, for JSON and Buffered SSE.

Every API the gateway serves (Chat Completions, Responses, Messages) is a `Frontend`. The gateway owns
everything between parsing and rendering (auth, the turn, abort on disconnect, heartbeats), so JSON and
SSE share one code path up to rendering. Buffered SSE means: `stream_open` frames at once, a
`heartbeat` frame every `protocol.sse_heartbeat_s` while the engine generates, then the complete terminal
sequence from `stream_result` (or `stream_error`). Nothing is streamed token by token.
Every committed response's id names its response node in the session (the gateway records it), so a
request may continue from an earlier response by id (`Lineage`) instead of replaying the history.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from relax_pipeline.canonical.form import Message
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.protocol.errors import ProtocolError
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
    """One model API.

    A front-end whose requests may continue a response stored in the session (Responses'
    `previous_response_id`) also has `parse_continued(body, memo, lineage)`; `parse_turn` picks it.
    """

    name: str
    paths: tuple[str, ...]
    """Resources it serves below `{prefix}/v1/` and `{prefix}/` (for example `chat/completions`)."""

    def parse(self, body: Any, memo: RequestMemo) -> TurnRequest:
        """Validate and canonicalize; raise CanonicalError/ProtocolError with the field path."""

    def wants_stream(self, body: Mapping[str, Any]) -> bool:
        """Whether the client asked for SSE (validates the `stream` field's type)."""

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


def parse_turn(frontend: Frontend, body: Any, memo: RequestMemo, lineage: Lineage) -> TurnRequest:
    """`frontend.parse`, or its `parse_continued(body, memo, lineage)` when it has one: an API whose requests
    may continue a stored response (Responses' `previous_response_id`) reads the session's history there."""
    continued = getattr(frontend, "parse_continued", None)
    return frontend.parse(body, memo) if continued is None else continued(body, memo, lineage)


def stream_flag(body: Mapping[str, Any]) -> bool:
    """The `stream` field as a boolean; anything but true/false/absent is a 400 naming `stream`."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ProtocolError(400, f"stream must be a boolean, got {stream!r}", "stream")
    return bool(stream)
