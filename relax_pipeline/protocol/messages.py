"""Anthropic Messages front-end: request JSON → `TurnRequest`, `TurnResult` → message JSON or SSE events.

Fields used: `system` (a string or text blocks → a leading system message), `messages` (roles user and
assistant; a `system` message of text blocks mid-conversation, as Claude Code sends, is a system turn),
`tools`, `max_tokens` (required), `stop_sequences` and `chat_template_kwargs` (as in Chat Completions);
`model` is echoed. Every other field (`thinking`, `metadata`, `temperature`, `tool_choice`,
`context_management`, ...), every unknown block field (`cache_control`, `citations`, ...) and every beta
query parameter is accepted and ignored. Only custom tools (no `type`, or `type: "custom"`) reach the
model; server tools (`web_search_20250305`, `bash_20250124`, ...) are dropped.

One Anthropic message may become several canonical messages: a user message's blocks are walked in
order, each `tool_result` becomes a tool message and each run of other blocks a user message. A
`tool_result` with `is_error: true` keeps its text, prefixed with "Error: ", since the canonical tool
message has no error flag. Content blocks, per the Messages spec:

- `text`; `image` (a `url` source, or a `base64` source, which becomes the data URI
  `data:<media_type>;base64,<data>`, so the same image sent through Chat hashes the same) in user content
  and in `tool_result` content; whether the model sees it is the turn service's decision;
- read as text, on lines of their own: `document` with a `text` or `content` source (its title, then its
  text; PDF, URL and file sources are refused), `search_result` (title, source, content text),
  `tool_reference` (Claude Code's tool search: "tool_reference: <tool_name>"), and the blocks of tools the
  provider runs (`server_tool_use`, `web_search_tool_result` and the other `*_tool_result`s, `mcp_tool_use`,
  `mcp_tool_result`, `container_upload`, and `browser_state` in a tool result) as "[<type>] <readable text>";
- assistant `thinking` becomes `reasoning_content`; `redacted_thinking` (opaque) is dropped, and so are
  thinking blocks outside assistant content; `tool_use` becomes a tool call.

Any other type, or a known one where it does not belong, is a 400 naming the type and the field path.

The expanded messages are Chat-form dicts paired with their Anthropic field path, so the session's
`RequestMemo` reuses the replayed prefix exactly as the Chat front-end does. Responses carry `thinking`
(with a stable hash as `signature`), `text` and `tool_use` blocks; tool-use ids are the forest's tool-call
ids, so a replay matches. `count_tokens` answers `v1/messages/count_tokens`; the gateway routes it.
Nothing is streamed token by token: the SSE sequence is sent whole when generation ends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from relax_pipeline.canonical.form import (
    CanonicalError,
    Context,
    Message,
    ToolCall,
    canonical_template_kwargs,
    canonical_tools,
    parse_message,
)
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.base import Lineage, ProtocolError, SSEFrame, TurnMeta, anthropic_body
from relax_pipeline.turn.records import TurnRequest, TurnResult

Item = tuple[str, dict[str, Any]]
"""An expanded message: its Anthropic field path and its Chat-form dict."""
ERROR_PREFIX = "Error: "
CUSTOM_TOOL_TYPES = (None, "custom")
SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                 "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                 "tool_search_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload")
"""Blocks of tools the API provider runs: rendered as text (their results were never our model's output)."""
READ_BLOCKS = ("text", "document", "search_result", "tool_reference")
DROPPED_BLOCKS = ("thinking", "redacted_thinking")
"""Dropped outside assistant content (and `redacted_thinking` everywhere: its content is opaque)."""
USER_BLOCKS = (*READ_BLOCKS, "image", "tool_result", *DROPPED_BLOCKS, *SERVER_BLOCKS)
RESULT_BLOCKS = (*READ_BLOCKS, "image", "browser_state")
ASSISTANT_BLOCKS = (*READ_BLOCKS, "tool_use", *DROPPED_BLOCKS, *SERVER_BLOCKS)
KNOWN_BLOCKS = frozenset((*USER_BLOCKS, *RESULT_BLOCKS, *ASSISTANT_BLOCKS))
PLAIN_KEYS = ("title", "url", "text", "tool_name", "file_id", "stdout", "stderr", "error_code", "content",
              "source", "data", "tool_references", "tabs")
"""Fields whose text a server tool's result is rendered with (base64 sources and encrypted fields are left out)."""


# --- request → canonical ---------------------------------------------------------------------------


def parse_request(body: Any, memo: RequestMemo | None = None) -> TurnRequest:
    """Validate a Messages body; errors carry the field path in `param`."""
    messages, hashes, context = parse_conversation(body, memo)
    return TurnRequest(messages, context, _max_tokens(body), _stop(body.get("stop_sequences")), None, hashes)


def parse_conversation(body: Any, memo: RequestMemo | None = None
                       ) -> tuple[tuple[Message, ...], tuple[bytes, ...], Context]:
    """The canonical messages, their chained hashes and the context (no `max_tokens` needed)."""
    if not isinstance(body, Mapping):
        raise CanonicalError("the request body must be a JSON object", None)
    context = Context(canonical_tools(_tools(body.get("tools"))),
                      canonical_template_kwargs(body.get("chat_template_kwargs")))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise CanonicalError("messages must be a non-empty list", "messages")
    items = _system(body.get("system")) + [item for i, m in enumerate(raw) for item in _expand(m, f"messages[{i}]")]
    messages, hashes = (memo or RequestMemo(0)).canonical(items, context, _parse_item)
    return messages, hashes, context


def _parse_item(item: Item, _index_path: str) -> Message:
    return parse_message(item[1], item[0])


def _system(raw: Any) -> list[Item]:
    if raw is None:
        return []
    text = raw if isinstance(raw, str) else "".join(_text_blocks(raw, "system"))
    return [("system", {"role": "system", "content": text})] if text else []


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    """Custom tools in the OpenAI function form; server tools are dropped."""
    if not isinstance(raw, list):
        return raw
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping):
            raise CanonicalError("a tool must be an object", f"tools[{i}]")
        if tool.get("type") in CUSTOM_TOOL_TYPES:
            out.append(_function_tool(tool, f"tools[{i}]"))
    return out


def _function_tool(tool: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise CanonicalError("a custom tool needs a non-empty 'name'", f"{param}.name")
    spec = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("input_schema")}
    return {"type": "function", "function": spec}


def _expand(raw: Any, param: str) -> list[Item]:
    """One Anthropic message as one or more Chat-form messages."""
    if not isinstance(raw, Mapping):
        raise CanonicalError("a message must be an object with 'role' and 'content'", param)
    role, content = raw.get("role"), raw.get("content")
    if role not in ("user", "assistant", "system"):
        raise CanonicalError(f"role must be 'user' or 'assistant' (or 'system'), got {role!r}", f"{param}.role")
    if isinstance(content, str):
        return [(param, {"role": role, "content": content})]
    if not isinstance(content, list):
        raise CanonicalError("content must be a string or a list of content blocks", f"{param}.content")
    if role == "system":  # Claude Code sends its environment notes as a system message mid-conversation
        return [(param, {"role": "system", "content": _system_text(content, param)})]
    return [_assistant(content, param)] if role == "assistant" else list(_user(content, param))


def _system_text(blocks: list[Any], param: str) -> str:
    """The text blocks of a system message, joined as one system turn."""
    texts = []
    for j, block in enumerate(blocks):
        if _kind(block, f"{param}.content[{j}]") != "text" or not isinstance(block.get("text"), str):
            raise CanonicalError("a system message holds text blocks only", f"{param}.content[{j}]")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _user(blocks: list[Any], param: str) -> Iterator[Item]:
    """Tool results become tool messages; each run of other blocks becomes a user message."""
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        path = f"{param}.content[{j}]"
        if _kind(block, path) == "tool_result":
            if parts:
                yield param, {"role": "user", "content": parts}
                parts = []
            yield path, _tool_result(block, path)
        else:
            parts += _parts_of(block, path, USER_BLOCKS, _last_text(parts))
    if parts or not blocks:
        yield param, {"role": "user", "content": parts or ""}


def _tool_result(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    content = block.get("content")
    parts: Any = content if isinstance(content, str) else _parts(content or [], f"{param}.content")
    if block.get("is_error") is True:
        parts = ERROR_PREFIX + parts if isinstance(parts, str) else [_chat_text(ERROR_PREFIX), *parts]
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise CanonicalError("a tool_result needs its 'tool_use_id'", f"{param}.tool_use_id")
    return {"role": "tool", "content": parts, "tool_call_id": call_id}


def _parts(raw: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise CanonicalError("must be a string or a list of content blocks", param)
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(raw):
        parts += _parts_of(block, f"{param}[{j}]", RESULT_BLOCKS, _last_text(parts))
    return parts


def _last_text(parts: list[dict[str, Any]]) -> str:
    return parts[-1].get("text", "") if parts else ""


def _parts_of(block: Any, param: str, allowed: tuple[str, ...], before: str) -> list[dict[str, Any]]:
    """A user or tool-result block as Chat content parts: images stay images, every other block is text
    (`before`: the text it follows)."""
    kind = _kind(block, param, allowed)
    if kind == "image":
        return [{"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{param}.source")}}]
    if kind == "document" and _source(block, param) == "content" and isinstance(block["source"]["content"], list):
        return _parts(block["source"]["content"], f"{param}.source.content")
    if kind in DROPPED_BLOCKS:
        return []
    return [_chat_text(_render(block, kind, param, before))]


def _chat_text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image_url(source: Any, param: str) -> str:
    """The URL of an image block's `url` or `base64` source."""
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    raise CanonicalError("an image block needs a source {type: url, url} or {type: base64, media_type, data}",
                         param)


def _assistant(blocks: list[Any], param: str) -> Item:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        path = f"{param}.content[{j}]"
        kind = _kind(block, path, ASSISTANT_BLOCKS)
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            calls.append(_tool_use(block, path))
        elif kind not in DROPPED_BLOCKS:
            texts.append(_render(block, kind, path, texts[-1] if texts else ""))
    message = {"role": "assistant", "content": "".join(texts), "tool_calls": calls or None,
               "reasoning_content": "".join(thoughts) if thoughts else None}
    return param, message


def _tool_use(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not block["name"]:
        raise CanonicalError("a tool_use block needs a non-empty 'name'", f"{param}.name")
    if not isinstance(block.get("input", {}), Mapping):
        raise CanonicalError("tool_use input must be an object", f"{param}.input")
    return {"id": block.get("id"), "function": {"name": block.get("name"), "arguments": block.get("input", {})}}


def _kind(block: Any, param: str, allowed: tuple[str, ...] = ()) -> Any:
    """The block's type; with `allowed`, a type outside it is a 400 naming the type and the field."""
    if not isinstance(block, Mapping):
        raise CanonicalError("a content block must be an object with a 'type'", param)
    kind = block.get("type")
    if allowed and kind not in allowed:
        known = "misplaced" if isinstance(kind, str) and kind in KNOWN_BLOCKS else "unsupported"
        raise CanonicalError(f"{known} content block type {kind!r} here; send one of {', '.join(allowed)}",
                             f"{param}.type")
    return kind


def _text(block: Any, param: str) -> str:
    _kind(block, param, ("text",))
    if not isinstance(block.get("text"), str):
        raise CanonicalError("a text block needs a 'text' string", f"{param}.text")
    return block["text"]


def _text_blocks(raw: Any, param: str) -> Iterator[str]:
    if not isinstance(raw, list):
        raise CanonicalError("must be a string or a list of text blocks", param)
    return (_text(block, f"{param}[{j}]") for j, block in enumerate(raw))


# --- blocks rendered as text ---------------------------------------------------------------------------------


def _render(block: Mapping[str, Any], kind: str, param: str, before: str) -> str:
    """A block the model reads as text: `text` as it is; every other kind on lines of its own (after a
    newline unless it starts the content or follows one)."""
    if kind == "text":
        return _text(block, param)
    text = _rendered(block, kind, param)
    return "\n" + text if before and not before.endswith("\n") else text


def _rendered(block: Mapping[str, Any], kind: str, param: str) -> str:
    if kind == "document":
        return _lines(block.get("title"), _document_text(block, param))
    if kind == "search_result":
        return _lines(block.get("title"), block.get("source"), "".join(_text_blocks(block.get("content"),
                                                                                     f"{param}.content")))
    if kind == "tool_reference":
        return _lines(f"tool_reference: {_name(block, 'tool_name', param)}")
    if kind in ("server_tool_use", "mcp_tool_use"):
        arguments = json.dumps(block.get("input"), sort_keys=True, ensure_ascii=False)
        return _lines(f"[{kind} {_name(block, 'name', param)}] {arguments}")
    return _lines(f"[{kind}] {_plain(block)}")


def _lines(*texts: Any) -> str:
    return "".join(f"{text}\n" for text in texts if isinstance(text, str) and text)


def _source(block: Mapping[str, Any], param: str) -> str:
    """A document's source type: `text` and `content` are read; PDF, URL and file sources are refused."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "text" and isinstance(source.get("data"), str):
        return kind
    if kind == "content" and isinstance(source.get("content"), str | list):
        return kind
    raise CanonicalError("a document needs a text source {type: text, data} or a content source {type: content, "
                         "content}; PDF, URL and file documents are not supported", f"{param}.source")


def _document_text(block: Mapping[str, Any], param: str) -> str:
    if _source(block, param) == "text":
        return block["source"]["data"]
    content = block["source"]["content"]
    return content if isinstance(content, str) else "".join(_text_blocks(content, f"{param}.source.content"))


def _name(block: Mapping[str, Any], key: str, param: str) -> str:
    if not isinstance(block.get(key), str) or not block[key]:
        raise CanonicalError(f"a {block.get('type')} block needs a non-empty '{key}'", f"{param}.{key}")
    return block[key]


def _plain(value: Any) -> str:
    """The readable text of a server tool's result: titles, URLs, outputs and errors (encrypted parts left out)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_plain(v) for v in value)
    if isinstance(value, Mapping) and value.get("type") != "base64":
        return " ".join(_plain(value[k]) for k in PLAIN_KEYS if value.get(k) not in (None, "", []))
    return "" if value is None or isinstance(value, Mapping) else json.dumps(value)


def _max_tokens(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CanonicalError(f"max_tokens is required and must be a positive integer, got {value!r}", "max_tokens")
    return value


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise CanonicalError("stop_sequences must be a list of strings", "stop_sequences")


def count_tokens(body: Any, template: ChatTemplate) -> dict[str, int]:
    """`v1/messages/count_tokens`: tokens of the full render with the generation prompt."""
    messages, _, context = parse_conversation(body)
    return {"input_tokens": template.prompt_length(messages, context)}


# --- canonical → response ---------------------------------------------------------------------------


class MessagesFrontend:
    """Anthropic Messages as a `Frontend`."""

    name = "messages"
    paths = ("messages",)

    def parse(self, body: Any, memo: RequestMemo, lineage: Lineage | None = None) -> TurnRequest:
        return parse_request(body, memo)

    def render(self, result: TurnResult, meta: TurnMeta) -> dict[str, Any]:
        return {**_envelope(meta), "content": _blocks(result.message), **_stop_info(result),
                "usage": _usage(result)}

    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        return anthropic_body(error)

    def stream_open(self, meta: TurnMeta) -> list[SSEFrame]:
        return [self.heartbeat()]

    def heartbeat(self) -> SSEFrame:
        return _event({"type": "ping"})

    def stream_result(self, result: TurnResult, meta: TurnMeta) -> list[SSEFrame]:
        start = {**_envelope(meta), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": result.prompt_tokens, "output_tokens": 0}}
        frames = [_event({"type": "message_start", "message": start})]
        for index, block in enumerate(_blocks(result.message)):
            frames += _block_events(index, block)
        delta = {"type": "message_delta", "delta": _stop_info(result),
                 "usage": {"output_tokens": len(result.output.output_ids)}}
        return [*frames, _event(delta), _event({"type": "message_stop"})]

    def stream_error(self, error: ProtocolError, meta: TurnMeta) -> list[SSEFrame]:
        return [_event(anthropic_body(error))]


def _event(data: dict[str, Any]) -> SSEFrame:
    return SSEFrame(data, event=data["type"])


def _envelope(meta: TurnMeta) -> dict[str, Any]:
    return {"id": "msg_" + meta.response_id.rsplit("-", 1)[-1], "type": "message", "role": "assistant",
            "model": meta.model}


def _usage(result: TurnResult) -> dict[str, int]:
    return {"input_tokens": result.prompt_tokens, "output_tokens": len(result.output.output_ids)}


def _stop_info(result: TurnResult) -> dict[str, Any]:
    """`stop_reason` and `stop_sequence`: length, then tool calls, then a matched stop string."""
    matched = result.output.matched_stop
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if result.message.tool_calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(matched, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _blocks(message: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content,
                       "signature": signature(message.reasoning_content)})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    return blocks + [_tool_use_block(call) for call in message.tool_calls]


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    """`input` is the arguments object; arguments that are not a JSON object are wrapped as `{"arguments"}`."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": call.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": args}


def signature(reasoning: str) -> str:
    """A stable stand-in for Anthropic's thinking signature: a hash of the reasoning text."""
    return hashlib.blake2b(reasoning.encode(), digest_size=16).hexdigest()


def _block_events(index: int, block: dict[str, Any]) -> list[SSEFrame]:
    """`content_block_start` with an empty block, its whole content as delta(s), `content_block_stop`."""
    kind = block["type"]
    if kind == "thinking":
        empty = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                  {"type": "signature_delta", "signature": block["signature"]}]
    elif kind == "text":
        empty, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    else:
        empty = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
    frames = [_event({"type": "content_block_start", "index": index, "content_block": empty})]
    frames += [_event({"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
    return [*frames, _event({"type": "content_block_stop", "index": index})]
