"""OpenAI Responses front-end: `POST v1/responses` input items → `TurnRequest`, `TurnResult` → response JSON.

Fields used: `instructions` (a leading system message), `input` (a string, or a list of items), `tools`
(flat function tools; hosted tool types such as `web_search` are ignored), `chat_template_kwargs` (as in
Chat Completions), `max_output_tokens` and `previous_response_id`; `model` is echoed. Every other field
(`include`, `prompt_cache_key`, `store`, `reasoning`, `text`, `tool_choice`, `parallel_tool_calls`,
`metadata`, `temperature`, `top_p`, ...) is accepted and ignored.

Input items: `message` items (or items with a `role` and no `type`) with roles user/assistant/system and
`developer` (read as system), content a string or text parts, user content also `input_image` parts
(`image_url` a data URI or an http(s) URL; `file_id` is not supported); `reasoning`, `function_call` and
`function_call_output` items. One assistant turn is a run of consecutive reasoning, assistant-message and
function-call items, in the order this module renders them (reasoning, then text, then calls); the run
becomes ONE canonical assistant message, so a replayed turn matches the response node it came from, and
the same conversation sent through Chat Completions lands on the same lineage. A function-call item's
`call_id` is the canonical `ToolCall.id`.

`previous_response_id`: every answer's id names its response node in the session, so a request may send
only the new items; the conversation is then the stored response's lineage plus the new items (new
`instructions` replace the lineage's leading system message; without them it is kept). An id that is not
one of this session's responses is a 400 naming `previous_response_id`.

Not supported: `item_reference` and hosted-tool items, `input_file` and image `file_id`s, and logprobs.
`stream=true` gets Buffered SSE in the event sequence of the Responses streaming spec: `response.created`
and `response.in_progress` at once, comment frames while generating, then per output item
`response.output_item.added` (the item without its content), its content events (reasoning:
`response.reasoning_summary_part.added`, `response.reasoning_summary_text.delta`/`.done`,
`response.reasoning_summary_part.done`; message: `response.content_part.added`,
`response.output_text.delta`/`.done`, `response.content_part.done`; function call:
`response.function_call_arguments.delta`/`.done`), each text whole in one delta, and
`response.output_item.done`; finally `response.completed` (or `response.incomplete` when the output hit
the token limit), all with increasing `sequence_number`s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax_pipeline.canonical.form import (
    CanonicalError,
    Context,
    Message,
    ToolCall,
    canonical_arguments,
    canonical_template_kwargs,
    canonical_tools,
    content_of,
    make_message,
    text_of,
)
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.protocol.base import Lineage, ProtocolError, SSEFrame, TurnMeta, openai_body
from relax_pipeline.turn.records import TurnRequest, TurnResult

MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output")
STREAM_START = 2
"""Sequence number of the first terminal event (`response.created` and `response.in_progress` are 0 and 1)."""
Unit = tuple[str, Any]
"""One canonical message to be: `(field path, raw item)`, or `(path, list of items)` for an assistant turn."""


# --- request ------------------------------------------------------------------------------------


def parse_request(body: Any, memo: RequestMemo | None = None, lineage: Lineage | None = None) -> TurnRequest:
    """Validate a Responses body; errors carry the field path (`input[3].content[0]`) in `param`.

    With `previous_response_id`, `lineage` gives the messages that response ended (None: no response is known).
    """
    if not isinstance(body, Mapping):
        raise CanonicalError("the request body must be a JSON object", None)
    kwargs = canonical_template_kwargs(body.get("chat_template_kwargs"))
    context = Context(canonical_tools(body.get("tools")), kwargs)
    units = _instructions(body.get("instructions")) + _units(body.get("input"))
    max_tokens = _max_tokens(body.get("max_output_tokens"))
    previous = body.get("previous_response_id")
    if previous is not None:
        return TurnRequest(_continued(previous, units, lineage), context, max_tokens)
    messages, hashes = (memo or RequestMemo(0)).canonical(units, context, parse_unit, "input")
    return TurnRequest(messages, context, max_tokens, hashes=hashes)


def _continued(previous: Any, units: list[Unit], lineage: Lineage | None) -> tuple[Message, ...]:
    """The stored response's messages, then the new items; new `instructions` take the place of a leading
    system message of the stored history (OpenAI does not carry instructions over)."""
    history = lineage(previous) if isinstance(previous, str) and lineage is not None else None
    if history is None:
        raise CanonicalError(f"previous_response_id {previous!r} is not a response of this session; send the id "
                             "of an earlier response of the same session, or the full conversation in `input`",
                             "previous_response_id")
    new = [parse_unit(unit, unit[0]) for unit in units]
    if units[0][0] != "instructions":
        return (*history, *new)
    return (new[0], *history[1 if history and history[0].role == "system" else 0 :], *new[1:])


def _instructions(raw: Any) -> list[Unit]:
    if raw is None or raw == "":
        return []
    if not isinstance(raw, str):
        raise CanonicalError("instructions must be a string", "instructions")
    return [("instructions", {"role": "system", "content": raw})]


def _units(raw: Any) -> list[Unit]:
    """Group input items: each item is one message, except that an assistant turn's items form one."""
    if isinstance(raw, str) and raw:
        return [("input", {"role": "user", "content": raw})]
    if not isinstance(raw, list) or not raw:
        raise CanonicalError("input must be a non-empty string or a non-empty list of items", "input")
    units: list[Unit] = []
    for i, item in enumerate(raw):
        kind = _item_type(item, f"input[{i}]")
        if not _in_turn(kind, item):
            units.append((f"input[{i}]", item))
        elif units and isinstance(units[-1][1], list) and _continues(kind, units[-1][1]):
            units[-1][1].append((i, item))
        else:
            units.append((f"input[{i}]", [(i, item)]))
    return units


def _item_type(item: Any, param: str) -> str:
    if not isinstance(item, Mapping):
        raise CanonicalError("an input item must be an object", param)
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise CanonicalError(f"unsupported input item type {kind!r}; send one of {', '.join(ITEM_TYPES)} "
                             "(replay items in full: item_reference and hosted-tool items are not supported)",
                             f"{param}.type")
    return kind


def _in_turn(kind: str, item: Mapping[str, Any]) -> bool:
    """Whether the item belongs to an assistant turn."""
    return kind in ("reasoning", "function_call") or (kind == "message" and item.get("role") == "assistant")


def _continues(kind: str, turn: list[tuple[int, Any]]) -> bool:
    """Whether the item extends the assistant turn: turns are rendered as reasoning, text, then calls, so
    reasoning or text after text or calls begins the next turn."""
    return kind == "function_call" or turn[-1][1].get("type", "message") == "reasoning"


def parse_unit(unit: Unit, _param: str) -> Message:
    """One canonical message from a grouped unit (the memo's per-item parse function)."""
    param, raw = unit
    if isinstance(raw, list):
        return _assistant_turn(raw)
    kind = raw.get("type", "message")
    if kind == "function_call_output":
        return _tool_output(raw, param)
    return _message(raw, param)


def _message(raw: Mapping[str, Any], param: str) -> Message:
    role = raw.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise CanonicalError(f"role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", f"{param}.role")
    content, images = content_of(raw.get("content"), f"{param}.content")
    return make_message(MESSAGE_ROLES[role], content, param, images=images)


def _tool_output(raw: Mapping[str, Any], param: str) -> Message:
    call_id = raw.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise CanonicalError("function_call_output needs the call_id of its function_call", f"{param}.call_id")
    output, images = content_of(raw.get("output"), f"{param}.output")
    return make_message("tool", output, param, tool_call_id=call_id, images=images)


def _assistant_turn(items: list[tuple[int, Any]]) -> Message:
    """Reasoning, text and function calls of one assistant turn, merged into one message."""
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for i, item in items:
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, param))
        elif kind == "function_call":
            calls.append(_function_call(item, param))
        else:
            texts.append(text_of(item.get("content"), f"{param}.content") or "")
    first = f"input[{items[0][0]}]"
    return make_message("assistant", "".join(texts), first, "\n".join(r for r in reasoning if r) or None,
                        tuple(calls))


def _reasoning_text(item: Mapping[str, Any], param: str) -> str:
    """The raw `content` texts when present, else the `summary` texts."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise CanonicalError(f"reasoning {key} must be a list of text parts", f"{param}.{key}")
        texts = [_text_part(p, f"{param}.{key}[{j}]") for j, p in enumerate(parts)]
        if texts:
            return "".join(texts)
    return ""


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):
        raise CanonicalError("a reasoning part must be an object with a 'text' string", param)
    return part["text"]


def _function_call(item: Mapping[str, Any], param: str) -> ToolCall:
    name, call_id = item.get("name"), item.get("call_id")
    if not isinstance(name, str) or not name:
        raise CanonicalError("a function_call needs a non-empty 'name'", f"{param}.name")
    if not isinstance(call_id, str) or not call_id:
        raise CanonicalError("a function_call needs its 'call_id'", f"{param}.call_id")
    return ToolCall(name, canonical_arguments(item.get("arguments", "{}"), f"{param}.arguments"), call_id)


def _max_tokens(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CanonicalError(f"max_output_tokens must be a positive integer, got {value!r}", "max_output_tokens")
    return value


# --- response -----------------------------------------------------------------------------------


class ResponsesFrontend:
    """OpenAI Responses as a `Frontend`."""

    name = "responses"
    paths = ("responses",)

    def parse(self, body: Any, memo: RequestMemo, lineage: Lineage | None = None) -> TurnRequest:
        return parse_request(body, memo, lineage)

    def render(self, result: TurnResult, meta: TurnMeta) -> dict[str, Any]:
        return _response(meta, _status(result), output_items(result, meta), _usage(result))

    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        return openai_body(error)

    def stream_open(self, meta: TurnMeta) -> list[SSEFrame]:
        shell = _response(meta, "in_progress", [], None)
        return [_event("response.created", 0, response=shell), _event("response.in_progress", 1, response=shell)]

    def heartbeat(self) -> SSEFrame:
        return SSEFrame("ping", comment=True)

    def stream_result(self, result: TurnResult, meta: TurnMeta) -> list[SSEFrame]:
        """Per output item: `.added`, its content events (whole text in one delta), `.done`; then the end."""
        events = [event for index, item in enumerate(output_items(result, meta)) for event in _item_events(index, item)]
        kind = "response.completed" if _status(result) == "completed" else "response.incomplete"
        events.append((kind, {"response": self.render(result, meta)}))
        return [_event(name, STREAM_START + i, **fields) for i, (name, fields) in enumerate(events)]

    def stream_error(self, error: ProtocolError, meta: TurnMeta) -> list[SSEFrame]:
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        message = f"{error.code}: {error.message}" if error.code else error.message
        failed = _response(meta, "failed", [], None)
        failed["error"] = {"code": code, "message": message, "param": error.param,
                           "type": openai_body(error)["error"]["type"]}
        return [_event("response.failed", STREAM_START, response=failed)]


def output_items(result: TurnResult, meta: TurnMeta) -> list[dict[str, Any]]:
    """Reasoning, text and function-call items of a turn; `call_id` is the forest's `ToolCall.id`."""
    message, suffix = result.message, meta.response_id
    status = "incomplete" if result.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append({"type": "reasoning", "id": f"rs_{suffix}",
                      "summary": [{"type": "summary_text", "text": message.reasoning_content}]})
    if message.content:
        items.append({"type": "message", "id": f"msg_{suffix}", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
    for i, call in enumerate(message.tool_calls):
        items.append({"type": "function_call", "id": f"fc_{suffix}_{i}", "call_id": call.id or f"call_{suffix}_{i}",
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def _status(result: TurnResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _usage(result: TurnResult) -> dict[str, Any]:
    completion = len(result.output.output_ids)
    return {"input_tokens": result.prompt_tokens, "output_tokens": completion,
            "total_tokens": result.prompt_tokens + completion,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _response(meta: TurnMeta, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
              ) -> dict[str, Any]:
    """A `response` object; `tools` is echoed empty (the request's tools are not kept per response)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": meta.response_id, "object": "response", "created_at": meta.created, "model": meta.model,
            "status": status, "error": None, "incomplete_details": incomplete, "instructions": None,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": None, "top_p": None, "usage": usage}


def _event(kind: str, sequence: int, **fields: Any) -> SSEFrame:
    return SSEFrame({"type": kind, "sequence_number": sequence, **fields}, event=kind)


# --- streaming events -----------------------------------------------------------------------------

Event = tuple[str, dict[str, Any]]
"""An SSE event before numbering: its type and its fields."""


def _item_events(index: int, item: dict[str, Any]) -> list[Event]:
    """One output item's events: `.added` with the item before its content, the content events, `.done`."""
    where = {"item_id": item["id"], "output_index": index}
    content = {"reasoning": _summary_events, "message": _text_events, "function_call": _argument_events}
    return [("response.output_item.added", {"output_index": index, "item": _opened(item)}),
            *content[item["type"]](item, where),
            ("response.output_item.done", {"output_index": index, "item": item})]


def _opened(item: dict[str, Any]) -> dict[str, Any]:
    """The item as `.added` shows it: no content yet (a streaming client appends the deltas to it)."""
    if item["type"] == "reasoning":
        return {**item, "summary": []}
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    return {**item, "arguments": "", "status": "in_progress"}


def _summary_events(item: dict[str, Any], where: dict[str, Any]) -> list[Event]:
    events: list[Event] = []
    for i, part in enumerate(item["summary"]):
        at = {**where, "summary_index": i}
        events += [("response.reasoning_summary_part.added", {**at, "part": {**part, "text": ""}}),
                   ("response.reasoning_summary_text.delta", {**at, "delta": part["text"]}),
                   ("response.reasoning_summary_text.done", {**at, "text": part["text"]}),
                   ("response.reasoning_summary_part.done", {**at, "part": part})]
    return events


def _text_events(item: dict[str, Any], where: dict[str, Any]) -> list[Event]:
    events: list[Event] = []
    for i, part in enumerate(item["content"]):
        at = {**where, "content_index": i}
        events += [("response.content_part.added", {**at, "part": {**part, "text": ""}}),
                   ("response.output_text.delta", {**at, "delta": part["text"], "logprobs": []}),
                   ("response.output_text.done", {**at, "text": part["text"], "logprobs": []}),
                   ("response.content_part.done", {**at, "part": part})]
    return events


def _argument_events(item: dict[str, Any], where: dict[str, Any]) -> list[Event]:
    return [("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}),
            ("response.function_call_arguments.done", {**where, "name": item["name"],
                                                       "arguments": item["arguments"]})]
