"""Markdown pieces the reference pages share: tables, code spans and prose made safe for a table cell.

MkDocs (Python-Markdown with the tables extension) reads `<name>` outside a code span as an HTML tag and `*...*`
as emphasis, and a `|` outside a code span as a cell border (inside one it stays in the cell). `prose` escapes
those outside code spans and joins a docstring's lines into one; `code` wraps a value in a code span that survives
a table. Nothing here reads the package.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def prose(text: str | None) -> str:
    """A docstring as one line of Markdown: lines joined, `<`, `*` and `|` escaped outside code spans."""
    if not text:
        return ""
    flat = " ".join(inspect.cleandoc(text).split())
    out, last = [], 0
    for match in _CODE_SPAN.finditer(flat):
        out.append(_escape(flat[last:match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(_escape(flat[last:]))
    return "".join(out)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("<", "&lt;").replace("*", "\\*").replace("|", "\\|")


def code(text: str) -> str:
    """`text` as a code span usable in a table cell (backticks fenced; Python-Markdown's tables keep a `|` inside a
    code span in its cell)."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def value(item: Any) -> str:
    """A config value as a command line writes it: null, true, 4, tokens, [1, 2], {} (a code span)."""
    if isinstance(item, str):
        return code(item) if item else code('""')
    return code(json.dumps(item, ensure_ascii=False, sort_keys=True))


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; an empty table renders as a line saying so."""
    rows = list(rows)
    if not rows:
        return "_(none)_\n"
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def generated_note(source: str) -> str:
    """The line under every page's title: what it is generated from and how to regenerate it."""
    return (f"_Generated from {source} by `python -m relax_pipeline.reference`; do not edit by hand "
            "(`tests/unit/test_reference_pages.py` fails when this page differs from what the code generates)._\n")
