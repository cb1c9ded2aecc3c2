"""Reasoning and tool-call parsers: generated text → content, reasoning_content and tool calls.

Parsers run on the whole decoded output of one turn (never streaming) and never evaluate model output
as code: tool-call bodies go through `json.loads` only. A malformed tool call stays in `content`; a
parse never fails a turn. Parser names follow SGLang's: `qwen3` / `deepseek-r1` reasoning and
`qwen25` / `hermes` JSON tool calls are built in. Other names (`qwen3_coder`, SGLang delegation) are
added by the protocols issue; an unknown name is refused at start by `check_parser_names`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from relax_pipeline.forest.canonical import ToolCall, canonical_arguments

REASONING_PARSERS: tuple[str, ...] = ("qwen3", "deepseek-r1")
TOOL_CALL_PARSERS: tuple[str, ...] = ("qwen25", "hermes")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedOutput:
    """One generated turn split into message fields; connects the engine output to the forest."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


def check_parser_names(reasoning: str | None, tool_call: str | None) -> None:
    """Refuse unknown parser names at start, naming the config key and the built-in choices."""
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ValueError(
            f"protocol.reasoning_parser={reasoning!r} is not built in; choose one of {list(REASONING_PARSERS)}"
        )
    if tool_call is not None and tool_call not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"protocol.tool_call_parser={tool_call!r} is not built in; choose one of {list(TOOL_CALL_PARSERS)}"
        )


class OutputParser:
    """Splits generated text with the configured reasoning and tool-call parsers."""

    def __init__(self, reasoning: str | None = "qwen3", tool_call: str | None = "qwen25") -> None:
        check_parser_names(reasoning, tool_call)
        self.reasoning = reasoning
        self.tool_call = tool_call

    def parse(self, text: str, reasoning_opened: bool = False) -> ParsedOutput:
        """Parse one turn's text; `reasoning_opened` means the prompt already opened `<think>`."""
        reasoning, rest = self._split_reasoning(text, reasoning_opened)
        calls: tuple[ToolCall, ...] = ()
        if self.tool_call is not None:
            rest, calls = _split_tool_calls(rest)
        return ParsedOutput(rest, reasoning, calls)

    def _split_reasoning(self, text: str, opened: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        body = text
        if body.startswith("<think>"):
            body, opened = body[len("<think>") :], True
        if "</think>" not in body:
            return (body.strip("\n") or None, "") if opened else (None, text)
        reasoning, _, content = body.partition("</think>")
        return reasoning.strip("\n") or None, content.lstrip("\n")


def _split_tool_calls(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    matches = list(_TOOL_CALL.finditer(text))
    calls = [_tool_call(m.group(1)) for m in matches]
    if not matches or any(c is None for c in calls):
        return text, ()
    content = text[: matches[0].start()].rstrip("\n")
    return content, tuple(c for c in calls if c is not None)


def _tool_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if not isinstance(args, dict | str):
        return None
    return ToolCall(data["name"], canonical_arguments(args, "tool_call"), new_call_id())


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
