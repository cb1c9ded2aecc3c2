"""Turn records: what a protocol front-end hands the turn service, and what it gets back.

`TurnRequest` is a model call with the wire format taken off (canonical messages, tools and
chat-template kwargs, the request's own limits); `TurnResult` is the committed turn a front-end renders;
`SamplingDefaults` is the training config's sampling that every request gets. Nothing here does work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.engine.base import GenerateResult


@dataclass(frozen=True)
class TurnRequest:
    """A protocol-independent model call; connects the protocol parsers to the turn service."""

    messages: tuple[Message, ...]
    context: Context = field(default_factory=Context)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    hashes: tuple[bytes, ...] = ()
    """Chained hashes of the messages when the parser already computed them (else computed on match)."""


@dataclass(frozen=True)
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
