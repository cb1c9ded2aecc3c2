"""The turn path's errors: `ProtocolError` (what a model call's client should see) and `LeaseClosed`.

A `ProtocolError` carries the HTTP status, the message, the field to fix (`param`, a path such as `messages[2].content`)
and an optional code (`context_length_exceeded`). The turn service raises it; the protocol layer renders
it in each API's shape (`protocol/base.py`). This module renders nothing.
"""

from __future__ import annotations

from relax_pipeline.canonical.form import CanonicalError


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


class LeaseClosed(Exception):
    """The session ended while its request was held; the request gets no answer from the model (the gateway
    answers 404)."""
