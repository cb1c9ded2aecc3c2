"""Delegation of parser names we do not build in to SGLang's own whole-output parsers.

With the optional `sglang` extra installed (GPU machines: `pip install sglang` pins a CUDA torch), a
`protocol.reasoning_parser` or `protocol.tool_call_parser` name outside our built-ins is served by
`sglang.srt.parser.reasoning_parser.ReasoningParser` or
`sglang.srt.function_call.function_call_parser.FunctionCallParser`, on the whole output of a turn
(`parse_non_stream`), never their streaming path. Names are checked at start against SGLang's own
registries. A parser failure never fails a turn: the text stays in `content`, as with our parsers.

This module only adapts; it does not import SGLang until a delegated name is used, and knows nothing
about protocols. Without SGLang, `chat/parsers.py` refuses other names at start with the built-ins.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from relax_pipeline.canonical.form import ToolCall, canonical_arguments

log = logging.getLogger(__name__)
_REASONING = "sglang.srt.parser.reasoning_parser"
_TOOLS = "sglang.srt.function_call.function_call_parser"
_PROTOCOL = ("sglang.srt.entrypoints.openai.protocol", "sglang.srt.openai_api.protocol")


def available() -> bool:
    """True when the `sglang` package can be imported."""
    return importlib.util.find_spec("sglang") is not None


def reasoning_names() -> tuple[str, ...]:
    return tuple(getattr(importlib.import_module(_REASONING).ReasoningParser, "DetectorMap", {}))


def tool_call_names() -> tuple[str, ...]:
    return tuple(getattr(importlib.import_module(_TOOLS).FunctionCallParser, "ToolCallParserEnum", {}))


class SGLangReasoning:
    """`ReasoningParser(name).parse_non_stream(text)` → (reasoning or None, the rest)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cls = importlib.import_module(_REASONING).ReasoningParser

    def split(self, text: str) -> tuple[str | None, str]:
        try:
            reasoning, rest = self._cls(model_type=self.name, stream_reasoning=False).parse_non_stream(text)
        except Exception:  # noqa: BLE001 - a parser failure keeps the text as content
            log.warning("sglang reasoning parser %r failed; the turn keeps its text as content", self.name,
                        exc_info=True)
            return None, text
        return (reasoning or None), rest or ""


class SGLangToolCalls:
    """`FunctionCallParser(tools, name).parse_non_stream(text)` → (content, canonical tool calls)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cls = importlib.import_module(_TOOLS).FunctionCallParser
        self._tool, self._function = _protocol_types()

    def split(self, text: str, tools: Sequence[Mapping[str, Any]], new_id: Any) -> tuple[str, tuple[ToolCall, ...]]:
        try:
            parser = self._cls(self._tools(tools), self.name)
            if not parser.has_tool_call(text):
                return text, ()
            content, items = parser.parse_non_stream(text)
            calls = tuple(ToolCall(i.name, canonical_arguments(i.parameters or "{}", "tool_call"), new_id())
                          for i in items)
        except Exception:  # noqa: BLE001 - malformed calls stay in content
            log.warning("sglang tool-call parser %r failed; the turn keeps its text as content", self.name,
                        exc_info=True)
            return text, ()
        return (content or "", calls) if calls else (text, ())

    def _tools(self, tools: Sequence[Mapping[str, Any]]) -> list[Any]:
        out = []
        for tool in tools:
            f = tool.get("function", {})
            function = self._function(name=f.get("name"), description=f.get("description"),
                                      parameters=f.get("parameters"))
            out.append(self._tool(type="function", function=function))
        return out


def _protocol_types() -> tuple[Any, Any]:
    """SGLang's pydantic `Tool` and `Function` (their module moved between SGLang versions)."""
    for name in _PROTOCOL:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.Tool, module.Function
    raise ImportError(f"sglang has none of {list(_PROTOCOL)}; this SGLang version is not supported")
