"""A stand-in `sglang` package (a fake) for testing parser delegation where SGLang cannot be installed.

`write_fake_sglang(folder)` writes SGLang's parser classes with one made-up format each; put the folder on
`sys.path` and `chat/sglang_parsers.py` delegates to them exactly as it would to SGLang's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_FAKE_SGLANG = {
    "sglang/srt/parser/reasoning_parser.py": '''
class ReasoningParser:
    DetectorMap = {"fake-think": None}

    def __init__(self, model_type, stream_reasoning=True):
        assert model_type in self.DetectorMap and stream_reasoning is False

    def parse_non_stream(self, text):
        if "[/THINK]" not in text:
            return None, text
        head, _, rest = text.partition("[/THINK]")
        return head.removeprefix("[THINK]"), rest
''',
    "sglang/srt/function_call/function_call_parser.py": '''
import json


class ToolCallItem:
    def __init__(self, tool_index, name, parameters):
        self.tool_index, self.name, self.parameters = tool_index, name, parameters


class FunctionCallParser:
    ToolCallParserEnum = {"fake-calls": None}
    seen_tools = []

    def __init__(self, tools, tool_call_parser):
        assert tool_call_parser in self.ToolCallParserEnum
        FunctionCallParser.seen_tools = [t.function.name for t in tools]

    def has_tool_call(self, text):
        return "[TOOL_CALLS]" in text

    def parse_non_stream(self, text):
        head, _, body = text.partition("[TOOL_CALLS]")
        calls = json.loads(body)
        return head, [ToolCallItem(i, c["name"], json.dumps(c["arguments"])) for i, c in enumerate(calls)]
''',
    "sglang/srt/entrypoints/openai/protocol.py": '''
class Function:
    def __init__(self, name, description=None, parameters=None):
        self.name, self.description, self.parameters = name, description, parameters


class Tool:
    def __init__(self, type, function):
        self.type, self.function = type, function
''',
}


def write_fake_sglang(folder: Any) -> None:
    """Write a stand-in `sglang` package into `folder` (put it on sys.path): SGLang's parser classes with
    one made-up format each (`fake-think`: `[THINK]...[/THINK]`; `fake-calls`: `[TOOL_CALLS] [json]`),
    so the delegation adapter is tested where SGLang itself cannot be installed (it pins a CUDA torch)."""
    root = Path(folder)
    for relative, source in _FAKE_SGLANG.items():
        path = root / relative
        for package in [path.parent, *path.parent.parents]:
            if package == root or root not in package.parents:
                break
            package.mkdir(parents=True, exist_ok=True)
            (package / "__init__.py").touch()
        path.write_text(source.lstrip())
