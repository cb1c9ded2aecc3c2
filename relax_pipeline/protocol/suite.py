"""ProtocolSuite: which model-API front-ends the gateway serves and how output text is parsed.

Built from the `protocol` config group: `apis` lists the front-ends the gateway serves (OpenAI Chat
Completions `chat`, OpenAI Responses `responses`, Anthropic Messages `messages`); naming one that does
not exist fails at start with the list of those that do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relax_pipeline.chat.parsers import OutputParser, check_parser_names
from relax_pipeline.protocol.base import Frontend
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend

_FRONTENDS: dict[str, Callable[[], Frontend]] = {
    "chat": ChatFrontend, "responses": ResponsesFrontend, "messages": MessagesFrontend,
}
SUPPORTED_APIS: tuple[str, ...] = tuple(_FRONTENDS)


@dataclass
class ProtocolSuite:
    """The `protocol` group's node, used as it is: front-end choice and parser names; connects the protocol
    config to the gateway."""

    apis: list[str] = field(default_factory=lambda: ["chat", "responses", "messages"])
    """Front-ends the gateway serves: chat (OpenAI Chat Completions), responses (OpenAI Responses), messages
    (Anthropic Messages)."""
    reasoning_parser: str | None = "qwen3"
    """SGLang reasoning-parser name used to split `<think>` text."""
    tool_call_parser: str | None = "qwen25"
    """SGLang tool-call-parser name used to extract tool calls."""
    service_prefix: str = "/agentic_api"
    """URL path the gateway serves under; RELAX_BASE_URL keeps it."""
    sse_heartbeat_s: float = 15.0
    """Seconds between Buffered SSE heartbeats."""

    def __post_init__(self) -> None:
        unknown = [a for a in self.apis if a not in SUPPORTED_APIS]
        if unknown or not self.apis:
            raise ValueError(f"protocol.apis={self.apis} is not supported; choose from {list(SUPPORTED_APIS)}")
        check_parser_names(self.reasoning_parser, self.tool_call_parser)

    def parser(self) -> OutputParser:
        return OutputParser(self.reasoning_parser, self.tool_call_parser)

    def frontends(self) -> list[Frontend]:
        """The front-end objects of `apis`, in order."""
        return [_FRONTENDS[api]() for api in self.apis]
