"""Protocol-shaped errors: one exception type, rendered per API.

Handlers raise `ProtocolError` (or let a `CanonicalError` from canonicalization through); the gateway
renders it as the OpenAI shape `{"error": {"message", "type", "param", "code"}}` or the Anthropic shape
`{"type": "error", "error": {"type", "message"}}` depending on the route. This module does not decide
which route is which; the gateway does.
"""

from __future__ import annotations

from typing import Any

from relax_pipeline.forest.canonical import CanonicalError

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


class ProtocolError(Exception):
    """An error the client should see, with its HTTP status and the field to fix."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_canonical(cls, error: CanonicalError) -> ProtocolError:
        return cls(400, error.message, error.param, error.code)


def openai_body(error: ProtocolError) -> dict[str, Any]:
    kind = _OPENAI_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "server_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def anthropic_body(error: ProtocolError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = f"{error.param}: {error.message}" if error.param else error.message
    return {"type": "error", "error": {"type": kind, "message": message}}
