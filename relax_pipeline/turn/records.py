"""Turn records: what a protocol front-end hands the turn service, and what it gets back.

`TurnRequest` is a model call with the wire format taken off (canonical messages, tools and
chat-template kwargs, the request's own limits); `TurnResult` is the committed turn a front-end renders;
`SamplingDefaults` is the training config's sampling that every request gets; `Lease` is what a session's
requests wait on (`turn/leases.py`'s `GroupLease`). Nothing here does work.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.engine.base import GenerateResult


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """A protocol-independent model call; connects the protocol parsers to the turn service."""

    messages: tuple[Message, ...]
    context: Context = field(default_factory=Context)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    hashes: tuple[bytes, ...] = ()
    """Chained hashes of the messages when the parser already computed them (else computed on match)."""


@dataclass(frozen=True, slots=True)
class TurnResult:
    """A committed turn; connects the turn service to the protocol renderers."""

    message: Message
    finish_reason: str
    """"stop", "length" or "tool_calls"."""
    prompt_tokens: int
    output: GenerateResult
    node_id: int


@dataclass(frozen=True)
class SamplingDefaults:
    """Training-config sampling that every request gets (request temperature/top_p are ignored)."""

    max_response_len: int = 256
    max_context_len: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


class Lease(Protocol):
    """The group lease a session's requests wait on (`turn/leases.py`'s `GroupLease`)."""

    def notify(self) -> None:
        """A session of the group exited or ended: the first-request barrier may be complete."""

    def generation(self, session: Any, rid: str, aborts: int) -> AbstractAsyncContextManager[Any]:
        """Wait for the barrier and the lease, then hold `session`'s generation `rid` (its flight)."""

    def count_abort(self, session: Any) -> None:
        """The lease preempted one of `session`'s generations (it resumes later)."""
