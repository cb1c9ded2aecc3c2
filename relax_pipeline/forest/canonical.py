"""Canonical form of messages, tools and chat-template kwargs, shared by every protocol front-end.

Every request, whatever API it arrived through, is projected onto one canonical conversation before it
touches the SessionForest; explicit exports written by agents go through the same projection. Two
histories that render to the same model input canonicalize to the same `Message` values and the same
chained hashes:

- roles are `system`, `user`, `assistant`, `tool`; user/system/tool content must be non-empty text;
  an assistant may omit text when it has tool calls or reasoning;
- text parts of a content list are concatenated; tool-call `arguments` become sorted compact JSON, so a
  Python- and a JavaScript-serialised call hash the same;
- unknown and null fields are dropped. Tool-call ids and `tool_call_id` are kept for rendering responses
  but are not part of the hash: they are labels chosen by the gateway, not model input.

Validation failures raise `CanonicalError` with `param`, the field path of the offending value
(`messages[2].content`), for the protocol layer to turn into a 400. This module does not know any wire
protocol and does not handle images (the protocols issue adds media parts).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
FORBIDDEN_TEMPLATE_KWARGS: tuple[str, ...] = ("add_generation_prompt", "tokenize", "tools")
HASH_BYTES = 16


class CanonicalError(ValueError):
    """A request or export that cannot be canonicalized; `param` is the field path to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ToolCall:
    """One function call of an assistant message; connects a parsed response to its replay."""

    name: str
    arguments: str
    """Sorted compact JSON when the arguments parse as JSON, else the text as given."""
    id: str | None = None

    def key(self) -> list[str]:
        return [self.name, self.arguments]


@dataclass(frozen=True)
class Message:
    """One canonical conversation message; connects protocol parsers to the forest and the template."""

    role: Role
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def key(self) -> bytes:
        """Bytes that identify the model-visible content of this message (ids excluded).

        Length-prefixed fields, so no content can imitate a field boundary; cheaper than JSON.
        """
        parts = [self.role, self.content, "\x00" if self.reasoning_content is None else "\x01" + self.reasoning_content]
        for call in self.tool_calls:
            parts += [call.name, call.arguments]
        return "".join(f"{len(p)}:{p}" for p in parts).encode()

    def to_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects (arguments as a mapping when JSON)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI Chat Completions form (arguments as JSON text), used by dumps and responses."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class Context:
    """Tools and template kwargs of a conversation: the root of a tree in the forest."""

    tools: tuple[Mapping[str, Any], ...] = ()
    """Function tools in the OpenAI `{"type": "function", "function": {...}}` form."""
    template_kwargs: Mapping[str, Any] | None = None

    def key(self) -> bytes:
        return _compact([list(self.tools), dict(self.template_kwargs or {})]).encode()

    @functools.cached_property
    def root_hash(self) -> bytes:
        """State hash of the root of this context's tree (computed once per object)."""
        return digest(self.key())

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [dict(t) for t in self.tools] or None

    def kwargs(self) -> dict[str, Any]:
        return dict(self.template_kwargs or {})


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    try:
        args: Any = json.loads(call.arguments)
    except ValueError:
        args = call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def chain(previous: bytes, message: Message) -> bytes:
    """The state hash after `message`, given the state hash before it."""
    return digest(previous + message.key())


def chain_all(context: Context, messages: Sequence[Message]) -> list[bytes]:
    """State hashes of every prefix: `[root, after m0, after m1, ...]`; linear in the input size."""
    hashes = [context.root_hash]
    for message in messages:
        hashes.append(chain(hashes[-1], message))
    return hashes


def canonical_arguments(arguments: Any, param: str) -> str:
    """Tool-call arguments as sorted compact JSON; text that is not JSON is kept verbatim."""
    if isinstance(arguments, str):
        return _canonical_json_text(arguments)
    if isinstance(arguments, Mapping):
        return _compact(arguments)
    raise CanonicalError("tool-call arguments must be a JSON string or an object", param)


@functools.lru_cache(maxsize=8192)
def _canonical_json_text(text: str) -> str:
    """Replayed histories resend the same argument texts every turn: canonicalize each once."""
    try:
        return _compact(json.loads(text))
    except ValueError:
        return text


def text_of(content: Any, param: str) -> str | None:
    """Concatenate a string or a list of text parts; None when absent."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise CanonicalError("content must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        texts.append(_part_text(part, f"{param}[{j}]"))
    return "".join(texts)


def _part_text(part: Any, param: str) -> str:
    if not isinstance(part, Mapping):
        raise CanonicalError("a content part must be an object with a 'type'", param)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "input_image", "image"):
        raise CanonicalError("this model is text-only: image input is not supported", param)
    raise CanonicalError(f"unsupported content part type {kind!r}; send text parts", param)


def make_message(
    role: Any,
    content: str | None,
    param: str,
    reasoning: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    tool_call_id: str | None = None,
) -> Message:
    """Build a validated canonical message; `param` is the message's field path."""
    if role not in ROLES:
        raise CanonicalError(f"role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    if role == "assistant":
        if not content and not tool_calls and not reasoning and content != "":
            raise CanonicalError("assistant message needs content, tool_calls or reasoning", f"{param}.content")
        return Message("assistant", content or "", reasoning or None, tool_calls)
    if not content:
        raise CanonicalError(f"{role} message content must be non-empty text", f"{param}.content")
    return Message(role, content, tool_call_id=tool_call_id if role == "tool" else None)


def canonical_tools(tools: Any, param: str = "tools") -> tuple[Mapping[str, Any], ...]:
    """Function tools in the OpenAI form, key order kept for rendering (hashing sorts keys);
    non-function tool types are ignored."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise CanonicalError("tools must be a list", param)
    out = []
    for i, tool in enumerate(tools):
        spec = _function_tool(tool, f"{param}[{i}]")
        if spec is not None:
            out.append(spec)
    return tuple(out)


def _function_tool(tool: Any, param: str) -> dict[str, Any] | None:
    if not isinstance(tool, Mapping):
        raise CanonicalError("a tool must be an object", param)
    if tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise CanonicalError("a function tool needs a non-empty 'name'", f"{param}.function.name")
    spec = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
    return json.loads(json.dumps({"type": "function", "function": spec}))  # a detached copy, order kept


def canonical_template_kwargs(kwargs: Any, param: str = "chat_template_kwargs") -> Mapping[str, Any] | None:
    """Template kwargs with null fields dropped; keys the gateway controls are refused."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise CanonicalError("chat_template_kwargs must be an object", param)
    for key in FORBIDDEN_TEMPLATE_KWARGS:
        if key in kwargs:
            raise CanonicalError(
                f"chat_template_kwargs.{key} is set by the gateway; remove it", f"{param}.{key}"
            )
    clean = {k: v for k, v in kwargs.items() if v is not None}
    return json.loads(_compact(clean)) or None
