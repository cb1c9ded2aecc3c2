"""OpenAI Chat message objects → canonical messages: the history form every API and every export shares.

Chat Completions requests, Anthropic and Responses tool turns re-expressed as chat messages, and the
explicit export records agents write (`{"messages": [...]}`) all carry OpenAI Chat message objects;
this module validates them and projects each onto a canonical `Message`. Errors are `CanonicalError`s
naming the field path (`messages[2].tool_calls[0].function.name`). It parses no request bodies (the
protocol front-ends do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax_pipeline.canonical.form import (
    CanonicalError,
    Message,
    ToolCall,
    canonical_arguments,
    content_of,
    make_message,
)


def parse_messages(raw: Any, param: str = "messages") -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise CanonicalError("messages must be a non-empty list", param)
    return tuple(parse_message(m, f"{param}[{i}]") for i, m in enumerate(raw))


def parse_message(raw: Any, param: str) -> Message:
    if not isinstance(raw, Mapping):
        raise CanonicalError("a message must be an object with 'role' and 'content'", param)
    role = raw.get("role")
    if role == "developer":  # OpenAI's newer name for the system role (Codex, o-series clients)
        role = "system"
    content, images = content_of(raw.get("content"), f"{param}.content")
    reasoning = raw.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise CanonicalError("reasoning_content must be a string", f"{param}.reasoning_content")
    calls = _tool_calls(raw.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else ()
    call_id = raw.get("tool_call_id")
    return make_message(role, content, param, reasoning, calls, call_id if isinstance(call_id, str) else None,
                        images)


def _tool_calls(raw: Any, param: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise CanonicalError("tool_calls must be a list", param)
    return tuple(_tool_call(c, f"{param}[{i}]") for i, c in enumerate(raw))


def _tool_call(raw: Any, param: str) -> ToolCall:
    fn = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise CanonicalError("a tool call needs function.name", f"{param}.function.name")
    args = canonical_arguments(fn.get("arguments", "{}"), f"{param}.function.arguments")
    call_id = raw.get("id")
    return ToolCall(fn["name"], args, call_id if isinstance(call_id, str) else None)
