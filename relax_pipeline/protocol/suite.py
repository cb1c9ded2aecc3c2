"""ProtocolSuite: which model-API front-ends the gateway serves and how output text is parsed.

Built from the `protocol` config group. This issue serves OpenAI Chat Completions; Responses and
Messages join with the protocols issue, and naming one now fails at start with that sentence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from relax_pipeline.engine.parsers import OutputParser, check_parser_names
from relax_pipeline.protocol.base import Frontend
from relax_pipeline.protocol.chat import ChatFrontend

_FRONTENDS: dict[str, Callable[[], Frontend]] = {"chat": ChatFrontend}
SUPPORTED_APIS: tuple[str, ...] = tuple(_FRONTENDS)


@dataclass(frozen=True)
class ProtocolSuite:
    """Front-end choice and parser names; connects the protocol config to the gateway."""

    apis: list[str] = field(default_factory=lambda: ["chat"])
    reasoning_parser: str | None = "qwen3"
    tool_call_parser: str | None = "qwen25"
    service_prefix: str = "/agentic_api"
    sse_heartbeat_s: float = 15.0

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
