"""Reasoning and tool-call parsers: generated text → content, reasoning_content and tool calls.

Parsers run on the whole decoded output of one turn (never streaming) and never evaluate model output
as code: tool-call bodies go through `json.loads` and regular expressions only. A malformed tool call
stays in `content`; a parse never fails a turn. Parser names follow SGLang's: `qwen3` / `deepseek-r1`
reasoning, `qwen25` / `hermes` JSON and `qwen3_coder` XML tool calls are built in. Any other name is
delegated to SGLang's own whole-output parsers when the `sglang` extra is installed
(`chat/sglang_parsers.py`) and refused at start by `check_parser_names` when it is not.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import ToolCall, canonical_arguments
from relax_pipeline.chat import sglang_parsers

REASONING_PARSERS: tuple[str, ...] = ("qwen3", "deepseek-r1")
TOOL_CALL_PARSERS: tuple[str, ...] = ("qwen25", "hermes", "qwen3_coder")
FORCED_REASONING = ("deepseek-r1",)
"""Parsers whose template opens `<think>` in the generation prompt: text before `</think>` is reasoning."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"^<function=([^>\s]+)>\s*(.*?)\s*</function>$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ParsedOutput:
    """One generated turn split into message fields; connects the engine output to the forest."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


def check_parser_names(reasoning: str | None, tool_call: str | None) -> None:
    """Refuse unknown parser names at start, naming the config key and the choices.

    Names outside the built-ins are SGLang's when the `sglang` extra is installed (see
    `chat/sglang_parsers.py`), and refused otherwise."""
    for key, name, builtin in (("reasoning_parser", reasoning, REASONING_PARSERS),
                               ("tool_call_parser", tool_call, TOOL_CALL_PARSERS)):
        if name is None or name in builtin:
            continue
        if not sglang_parsers.available():
            raise ValueError(f"protocol.{key}={name!r} is not built in; choose one of {list(builtin)}, or install "
                             "the sglang extra (GPU machines) to use SGLang's own parsers")
        known = sglang_parsers.reasoning_names() if key == "reasoning_parser" else sglang_parsers.tool_call_names()
        if name not in known:
            raise ValueError(f"protocol.{key}={name!r} is neither built in {list(builtin)} nor one of SGLang's "
                             f"{sorted(known)}")


class OutputParser:
    """Splits generated text with the configured reasoning and tool-call parsers."""

    def __init__(self, reasoning: str | None = "qwen3", tool_call: str | None = "qwen25") -> None:
        check_parser_names(reasoning, tool_call)
        self.reasoning = reasoning
        self.tool_call = tool_call
        delegated = reasoning is not None and reasoning not in REASONING_PARSERS
        self._sglang_reasoning = sglang_parsers.SGLangReasoning(reasoning) if delegated else None
        delegated = tool_call is not None and tool_call not in TOOL_CALL_PARSERS
        self._sglang_tools = sglang_parsers.SGLangToolCalls(tool_call) if delegated else None

    def parse(self, text: str, reasoning_opened: bool = False,
              tools: Sequence[Mapping[str, Any]] = ()) -> ParsedOutput:
        """Parse one turn's text; `reasoning_opened` means the prompt already opened `<think>`; `tools` are the
        request's function tools (SGLang's tool-call parsers use them)."""
        opened = reasoning_opened or self.reasoning in FORCED_REASONING
        if self._sglang_reasoning is not None:
            reasoning, rest = self._sglang_reasoning.split(text)
        else:
            reasoning, rest = self._split_reasoning(text, opened)
        calls: tuple[ToolCall, ...] = ()
        if self._sglang_tools is not None:
            rest, calls = self._sglang_tools.split(rest, tools, new_call_id)
        elif self.tool_call is not None:
            rest, calls = _split_tool_calls(rest, _xml_call if self.tool_call == "qwen3_coder" else _tool_call)
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


def _split_tool_calls(text: str, parse_one: Callable[[str], ToolCall | None]) -> tuple[str, tuple[ToolCall, ...]]:
    """Content before the first call and the calls; any malformed call keeps the whole text as content."""
    if "<tool_call>" not in text:  # every match starts with it: the usual answer without calls skips the regex
        return text, ()
    matches = list(_TOOL_CALL.finditer(text))
    calls = [parse_one(m.group(1)) for m in matches]
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


def _xml_call(body: str) -> ToolCall | None:
    """`<function=name><parameter=key>value</parameter>...</function>` (Qwen3-Coder); values that parse
    as JSON are kept typed, others as strings."""
    match = _XML_FUNCTION.match(body)
    if match is None:
        return None
    args = {key: _xml_value(value) for key, value in _XML_PARAMETER.findall(match.group(2))}
    return ToolCall(match.group(1), canonical_arguments(args, "tool_call"), new_call_id())


def _xml_value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)
