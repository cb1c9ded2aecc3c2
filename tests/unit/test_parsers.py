"""Reasoning and tool-call parsers on whole outputs: every built-in name, malformed calls kept as text,
and delegation of other names to SGLang's parsers (against `relax_pipeline.testing.sglang_stub.write_fake_sglang`)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_pipeline.chat.parsers import OutputParser, check_parser_names
from relax_pipeline.testing.sglang_stub import write_fake_sglang


def test_qwen3_reasoning_and_qwen25_json_call() -> None:
    out = OutputParser("qwen3", "qwen25").parse(
        '<think>\nplan\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"b": 2, "a": 1}}\n</tool_call>')
    assert out.reasoning == "plan" and out.content == "Sure."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("f", '{"a":1,"b":2}')]
    assert out.tool_calls[0].id.startswith("call_")


def test_qwen3_without_think_is_all_content_but_deepseek_r1_is_all_reasoning() -> None:
    assert OutputParser("qwen3", None).parse("just text").reasoning is None
    r1 = OutputParser("deepseek-r1", None)
    assert r1.parse("thinking so far").reasoning == "thinking so far"
    assert r1.parse("why\n</think>\n\nanswer").content == "answer"


def test_hermes_parses_several_calls() -> None:
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>')
    out = OutputParser(None, "hermes").parse(text)
    assert [c.name for c in out.tool_calls] == ["a", "b"] and out.content == ""


def test_qwen3_coder_xml_call_keeps_typed_values() -> None:
    text = ("Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nred apples\n</parameter>\n"
            "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>")
    out = OutputParser("qwen3", "qwen3_coder").parse(text)
    assert out.content == "Let me look."
    assert out.tool_calls[0].name == "search"
    assert json.loads(out.tool_calls[0].arguments) == {"query": "red apples", "limit": 5}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>',
    '<tool_call>\n["not", "an", "object"]\n</tool_call>',
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n__import__("os").system("echo pwned")\n</tool_call>',
])
def test_malformed_calls_stay_in_content_and_are_never_evaluated(text: str) -> None:
    out = OutputParser("qwen3", "qwen25").parse(text)
    assert out.tool_calls == () and out.content == text


def test_malformed_xml_call_stays_in_content() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=x>1</parameter>\n</tool_call>"
    out = OutputParser(None, "qwen3_coder").parse(text)
    assert out.tool_calls == () and out.content == text


def test_unknown_names_are_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"protocol.tool_call_parser='llama3' is not built in; choose one of"):
        check_parser_names("qwen3", "llama3")
    with pytest.raises(ValueError, match=r"protocol.reasoning_parser='kimi'.*'deepseek-r1'"):
        check_parser_names("kimi", None)


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    write_fake_sglang(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def test_other_names_are_delegated_to_sglang_parsers(fake_sglang: None) -> None:
    check_parser_names("fake-think", "fake-calls")
    parser = OutputParser("fake-think", "fake-calls")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    out = parser.parse('[THINK]plan[/THINK]Looking. [TOOL_CALLS] [{"name": "lookup", "arguments": {"b": 1, "a": 2}}]',
                       tools=tools)
    assert out.reasoning == "plan" and out.content == "Looking. "
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("lookup", '{"a":2,"b":1}')]
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    assert FunctionCallParser.seen_tools == ["lookup"], "the request's tools reach SGLang's parser"
    broken = parser.parse("[TOOL_CALLS] [{not json", tools=tools)
    assert broken.content == "[TOOL_CALLS] [{not json" and broken.tool_calls == (), "a failure keeps the text"


def test_names_sglang_does_not_know_are_refused_with_both_lists(fake_sglang: None) -> None:
    with pytest.raises(ValueError, match=r"tool_call_parser='nope' is neither built in .*'qwen25'.*\['fake-calls'\]"):
        check_parser_names("qwen3", "nope")


def test_without_sglang_other_names_are_refused_naming_the_extra() -> None:
    with pytest.raises(ValueError, match=r"install the sglang extra"):
        check_parser_names("qwen3", "mistral")
