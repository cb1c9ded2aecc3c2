"""The session input and output files of the agent process contract (docs/design.md §3.2).

Input: `build_input` turns a dataset row's input and metadata into `{"messages": [...], "metadata": {...}}`
(either key absent when the row has none; a string becomes one user message) and `write_input` writes it
as UTF-8 JSON to the file named by `RELAX_INPUT_JSON`. A row's images replace its `<image>` placeholders,
in order, as OpenAI `image_url` parts: local sources become RGB PNG data URIs, URLs pass through
(`data/media.py`).

Output: `parse_output` reads the file named by `RELAX_OUTPUT_JSON` after the agent exits:

- absent, empty or whitespace only: implicit export (every context of the session), no reward;
- one JSON object without `"messages"` (`{"metadata"?, "reward"?}`): implicit export with that reward;
- one JSON object with `"messages"`: one explicit record, named by its `"name"` or `"main"` when absent;
- JSONL: one explicit record per non-empty line, `{"name", "messages", "tools"?, "chat_template_kwargs"?,
  "metadata"?, "reward"?}`, names non-empty and unique within the file;
- a JSON array: an error ("write JSONL, not a JSON array").

A reward is any JSON value (number, object, null) and is passed on untouched; an absent reward and
`null` both read as None. Unknown keys are rejected so that a typo ("message") never silently turns an
explicit export into an implicit one. Every error is an `AgentOutputError` naming the file, the line
where there is one, and the fix.

The record an explicit export parses into, `ExportRecord`, is declared here with the file it is read from;
`forest/export.py` matches it to recorded turns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_pipeline.data.media import PLACEHOLDER, image_parts, image_url

SINGLE_RECORD_NAME = "main"
"""Name of the explicit record written as one JSON object without a `"name"`."""

_IMPLICIT_KEYS = frozenset({"metadata", "reward"})
_RECORD_KEYS = frozenset({"name", "messages", "tools", "chat_template_kwargs", "metadata", "reward"})


@dataclass(frozen=True)
class ExportRecord:
    """One context the agent exports explicitly; connects the agent's output file to the forest matcher."""

    name: str | None
    """Unique within one output file; "main" for a single JSON object without one (always set on parse)."""
    messages: list[dict[str, Any]]
    """The conversation as the agent sees it, in OpenAI chat message form; never empty."""
    tools: list[dict[str, Any]] | None
    """Tool definitions offered with these messages, or None."""
    chat_template_kwargs: dict[str, Any] | None
    """Extra chat template arguments (for example `enable_thinking`), or None."""
    metadata: dict[str, Any]
    """Free-form metadata for reward functions; empty when absent."""
    reward: object
    """The agent's own reward for this context: any JSON value, None when absent or null."""


class AgentOutputError(ValueError):
    """The agent's output file breaks the contract; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class AgentOutput:
    """What one agent session exported; connects `parse_output` to the reward and credit stages."""

    implicit: bool
    """True when the agent exported nothing explicitly, so every recorded context counts."""
    records: tuple[ExportRecord, ...]
    """The explicit records in file order; empty for an implicit export."""
    reward: object
    """Session reward of an implicit export (any JSON value or None); None for an explicit export."""
    metadata: dict[str, Any]
    """Session metadata of an implicit export; empty for an explicit export."""


def build_input(row_input: str | list[dict[str, Any]] | None, metadata: dict[str, Any] | None,
                images: Sequence[Any] = ()) -> dict:
    """Build the input file payload from a row's input (string or messages), metadata and images."""
    payload: dict[str, Any] = {}
    urls = [image_url(source) for source in images]
    if isinstance(row_input, str):
        payload["messages"] = [_user_message(row_input, urls)]
    elif isinstance(row_input, list):
        payload["messages"] = _with_images(_checked_messages(row_input), urls)
    elif row_input is not None:
        raise TypeError(f"row input must be a string or a list of messages, got {type(row_input).__name__}")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"row metadata must be a dict, got {type(metadata).__name__}")
        payload["metadata"] = metadata
    return payload


def _user_message(text: str, urls: list[str]) -> dict[str, Any]:
    """One user message holding `text`, with image parts where its `<image>` placeholders were."""
    return {"role": "user", "content": image_parts(text, urls) if urls else text}


def _with_images(messages: list[dict[str, Any]], urls: list[str]) -> list[dict[str, Any]]:
    """Copies of the messages whose placeholders take the next images in order (unchanged without images)."""
    if not urls:
        return messages
    queue = list(urls)
    out = [{**m, "content": _content_with_images(m.get("content"), queue)} for m in messages]
    if queue:
        raise ValueError(f"{len(queue)} image(s) left over: the messages have fewer {PLACEHOLDER} placeholders")
    return out


def _content_with_images(content: Any, queue: list[str]) -> Any:
    """A content string or part list with its placeholders replaced by the next queued images."""
    if isinstance(content, list):
        return _parts_with_images(content, queue)
    if not isinstance(content, str) or PLACEHOLDER not in content:
        return content
    taken = queue[: content.count(PLACEHOLDER)]
    del queue[: len(taken)]
    return image_parts(content, taken)


def _parts_with_images(parts: list[Any], queue: list[str]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and PLACEHOLDER in str(part.get("text")):
            out.extend(_content_with_images(part["text"], queue))
        else:
            out.append(part)
    return out


def _checked_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Return `messages` after checking each is a dict with a "role"."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise TypeError(f"row input message {i} must be a dict with a 'role' key, got {message!r}")
    return messages


def write_input(path: Path, payload: dict[str, Any]) -> None:
    """Write the input payload as UTF-8 JSON (non-ASCII kept as is)."""
    path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")


def parse_output(path: Path) -> AgentOutput:
    """Read the agent's output file after it exits; see the module docstring for the rules."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if not text.strip():
        return AgentOutput(implicit=True, records=(), reward=None, metadata={})
    if text.lstrip().startswith("["):
        raise AgentOutputError(f"{path}: the output is a JSON array; write JSONL, not a JSON array")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole_error:
        return AgentOutput(implicit=False, records=_parse_jsonl(path, text, whole_error), reward=None,
                           metadata={})
    return _parse_object(path, document)


def _parse_object(path: Path, document: object) -> AgentOutput:
    """Interpret a whole-file JSON document: implicit export or one explicit record."""
    if not isinstance(document, dict):
        raise AgentOutputError(f"{path}: the output must be a JSON object or JSONL of objects, "
                               f"got {type(document).__name__}")
    if "messages" in document:
        record = _record(path, None, document, default_name=SINGLE_RECORD_NAME)
        return AgentOutput(implicit=False, records=(record,), reward=None, metadata={})
    _check_keys(path, None, document, _IMPLICIT_KEYS, 'an implicit export (an explicit one needs "messages")')
    metadata = _metadata(path, None, document)
    return AgentOutput(implicit=True, records=(), reward=document.get("reward"), metadata=metadata)


def _parse_jsonl(path: Path, text: str, whole_error: json.JSONDecodeError) -> tuple[ExportRecord, ...]:
    """Parse one explicit record per non-empty line; names must be unique."""
    records: list[ExportRecord] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = _record(path, lineno, _load_line(path, lineno, line, whole_error, first=not records))
        if record.name in seen:
            raise AgentOutputError(f"{path}: line {lineno}: duplicate record name {record.name!r} "
                                   f"(first on line {seen[record.name]}); give every record its own name")
        seen[str(record.name)] = lineno
        records.append(record)
    return tuple(records)


def _load_line(path: Path, lineno: int, line: str, whole_error: json.JSONDecodeError, first: bool) -> Any:
    """Decode one JSONL line; on the first line report the whole-document error (a broken JSON object)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as line_error:
        error = whole_error if first else line_error
        lineno = whole_error.lineno if first else lineno
        raise AgentOutputError(f"{path}: line {lineno}: invalid JSON ({error.msg}, column {error.colno}); "
                               "write one JSON object, or JSONL with one complete object per line") from None


def _record(path: Path, lineno: int | None, obj: Any, default_name: str | None = None) -> ExportRecord:
    """Validate one explicit record; `default_name` applies only to the single-object form."""
    where = _where(path, lineno)
    if not isinstance(obj, dict):
        raise AgentOutputError(f"{where}: each JSONL line must be a JSON object, got {type(obj).__name__}")
    _check_keys(path, lineno, obj, _RECORD_KEYS, "an explicit record")
    return ExportRecord(
        name=_name(where, default_name if obj.get("name") is None else obj["name"]),
        messages=_messages(where, obj.get("messages")),
        tools=_optional(where, obj, "tools", list, "a list of tool definitions"),
        chat_template_kwargs=_optional(where, obj, "chat_template_kwargs", dict, "an object"),
        metadata=_metadata(path, lineno, obj),
        reward=obj.get("reward"),
    )


def _name(where: str, name: object) -> str:
    """A record name: a non-empty string."""
    if not isinstance(name, str) or not name:
        raise AgentOutputError(f'{where}: "name" must be a non-empty string, got {name!r}; '
                               "name every JSONL record")
    return name


def _messages(where: str, messages: object) -> list[dict[str, Any]]:
    """A record's messages: a non-empty list of objects."""
    if not isinstance(messages, list) or not messages:
        raise AgentOutputError(f'{where}: "messages" must be a non-empty list of messages, got {messages!r}')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise AgentOutputError(f'{where}: "messages"[{i}] must be an object with "role" and "content"')
    return messages


def _optional(where: str, obj: dict, key: str, kind: type, described: str) -> Any:
    """An optional field of the given JSON type; None when absent or null."""
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise AgentOutputError(f'{where}: "{key}" must be {described} or absent, got {type(value).__name__}')
    return value


def _metadata(path: Path, lineno: int | None, obj: dict) -> dict[str, Any]:
    """The "metadata" object; empty when absent or null."""
    return _optional(_where(path, lineno), obj, "metadata", dict, "an object") or {}


def _check_keys(path: Path, lineno: int | None, obj: dict, allowed: frozenset[str], what: str) -> None:
    """Reject keys outside `allowed`, naming the allowed ones."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise AgentOutputError(f"{_where(path, lineno)}: unknown key(s) {unknown} in {what}; "
                               f"allowed: {sorted(allowed)} (put extra data under \"metadata\")")


def _where(path: Path, lineno: int | None) -> str:
    """`path` or `path: line N` for error messages."""
    return f"{path}" if lineno is None else f"{path}: line {lineno}"
