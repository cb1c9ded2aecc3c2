"""Protocol-shaped errors: one exception type, rendered per API.

Handlers raise `ProtocolError` (or let a `CanonicalError` from canonicalization through); the gateway
renders it as the OpenAI shape `{"error": {"message", "type", "param", "code"}}` or the Anthropic shape
`{"type": "error", "error": {"type", "message"}}` depending on the route. This module does not decide
which route is which; the gateway does.
"""

from __future__ import annotations

from typing import Any

from relax_pipeline.turn.errors import ProtocolError

__all__ = ["ProtocolError", "anthropic_body", "openai_body"]

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
