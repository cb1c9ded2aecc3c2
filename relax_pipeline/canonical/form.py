"""Canonical form of messages, tools and chat-template kwargs, shared by every protocol front-end.

Every request, whatever API it arrived through, is projected onto one canonical conversation before it
touches the SessionForest; explicit exports written by agents go through the same projection. Two
histories that render to the same model input canonicalize to the same `Message` values and the same
chained hashes:

- roles are `system`, `user`, `assistant`, `tool`; user/system content must be non-empty (text or, for
  user messages, images); a tool result may be empty (a tool that printed nothing); an assistant may
  omit text when it has tool calls or reasoning;
- text parts of a content list are concatenated; tool-call `arguments` become sorted compact JSON, so a
  Python- and a JavaScript-serialised call hash the same;
- image parts (`image_url` with a URL string or `{"url"}`, Responses `input_image`) become `Image`s placed
  at a text offset; a message's hash covers each image's offset and a 16-byte digest of its URL (a data
  URI or an http(s) URL), so replays do not rehash megabytes of base64 per turn. Images are accepted in
  user and tool messages; whether the model can see them is the turn service's question;
- unknown and null fields are dropped. Tool-call ids and `tool_call_id` are kept for rendering responses
  but are not part of the hash: they are labels chosen by the gateway, not model input.

OpenAI Chat message objects are the history form every API and every export shares: Chat Completions
requests, Anthropic and Responses tool turns re-expressed as chat messages, and the explicit export records
agents write (`{"messages": [...]}`); `parse_message` validates one and projects it onto a `Message`.

The session memo that reuses a replayed history's canonical prefix is `canonical/memo.py`.

Validation failures raise `CanonicalError` with `param`, the field path of the offending value
(`messages[2].tool_calls[0].function.name`), for the protocol layer to turn into a 400. This module parses
no request bodies (the protocol front-ends do) and does not decode images (`data/media.py` does).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
FORBIDDEN_TEMPLATE_KWARGS: tuple[str, ...] = ("add_generation_prompt", "tokenize", "tools")
HASH_BYTES = 16
IMAGE_ROLES: tuple[str, ...] = ("user", "tool")
IMAGE_URL_PREFIXES: tuple[str, ...] = ("data:", "http://", "https://")
TEXT_ONLY_MESSAGE = "this model is text-only: image input is not supported"


class CanonicalError(ValueError):
    """A request or export that cannot be canonicalized; `param` is the field path to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of an assistant message; connects a parsed response to its replay."""

    name: str
    arguments: str
    """Sorted compact JSON when the arguments parse as JSON, else the text as given."""
    id: str | None = None

    def key(self) -> list[str]:
        return [self.name, self.arguments]


@dataclass(frozen=True, slots=True)
class Image:
    """One image of a user or tool message; connects protocol parsers to the vision processor and the forest."""

    url: str = field(compare=False, repr=False)
    """A data URI or an http(s) URL, as the client sent it."""
    offset: int
    """Position in the message's text where the image sits."""
    digest: bytes
    """Digest of `url`: the image's identity in hashes and equality."""
    param: str | None = field(default=None, compare=False)
    """Field path of the part it came from, for errors about it."""

    def part(self, inline: bool = True) -> dict[str, Any]:
        """The OpenAI `image_url` part; with `inline=False` a data URI is replaced by its digest."""
        url = self.url if inline or not self.url.startswith("data:") else f"data:elided;blake2b={self.digest.hex()}"
        return {"type": "image_url", "image_url": {"url": url}}


@dataclass(frozen=True, slots=True)
class Message:
    """One canonical conversation message; connects protocol parsers to the forest and the template."""

    role: Role
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[Image, ...] = ()
    """Images placed in `content` at their offsets (user and tool messages only)."""

    def key(self) -> bytes:
        """Bytes that identify the model-visible content of this message (ids excluded).

        Length-prefixed fields, so no content can imitate a field boundary; cheaper than JSON.
        """
        reasoning = "\x00" if self.reasoning_content is None else "\x01" + self.reasoning_content
        return _length_prefixed([self.role, self.content, reasoning, *self._calls_and_images()])

    def visible_key(self) -> bytes:
        """`key` without `reasoning_content`: what a harness that drops reasoning still replays (role,
        content, tool calls, images). `rollout.history=tokens` matches re-sent assistant turns by it."""
        return _length_prefixed([self.role, self.content, *self._calls_and_images()])

    def _calls_and_images(self) -> list[str]:
        parts: list[str] = []
        for call in self.tool_calls:
            parts += [call.name, call.arguments]
        for image in self.images:
            parts += ["\x02", str(image.offset), image.digest.hex()]
        return parts

    def content_parts(self, inline: bool = True) -> list[dict[str, Any]]:
        """Text and image parts in order (OpenAI form); used when the message has images."""
        parts: list[dict[str, Any]] = []
        start = 0
        for image in self.images:
            if image.offset > start:
                parts.append({"type": "text", "text": self.content[start : image.offset]})
            parts.append(image.part(inline))
            start = image.offset
        if start < len(self.content):
            parts.append({"type": "text", "text": self.content[start:]})
        return parts

    def to_template(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects (arguments as a mapping when JSON; images as
        `{"type": "image"}` parts, the form vision-language templates render)."""
        content: Any = self.content
        if self.images:
            content = [p if p["type"] == "text" else {"type": "image"} for p in self.content_parts()]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def to_openai(self, inline_media: bool = True) -> dict[str, Any]:
        """The OpenAI Chat Completions form (arguments as JSON text), used by dumps and responses.

        Images become `image_url` parts; `inline_media=False` replaces data URIs by their digest (dumps).
        """
        content: Any = self.content_parts(inline_media) if self.images else self.content
        out: dict[str, Any] = {"role": self.role, "content": content}
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


def _length_prefixed(parts: list[str]) -> bytes:
    return "".join([f"{len(p)}:{p}" for p in parts]).encode()


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    arguments = arguments_value(call.arguments)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


_LONG_DIGITS = re.compile(r"[0-9]{19}").search
_FLOAT_HINT = re.compile(r"[0-9][.eE]").search


def arguments_value(text: str) -> Any:
    """Tool-call arguments as the value `json.loads` reads (orjson where it reads them: the same value, several
    times faster; the standard library for what orjson refuses, NaN and lone surrogates, and for a text with a run of
    19 digits or more, since orjson reads an integer past 64 bits as a float), else the text."""
    if _LONG_DIGITS(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def chain(previous: bytes, message: Message) -> bytes:
    """The state hash after `message`, given the state hash before it."""
    return digest(previous + message.key())


def chain_all(context: Context, messages: Sequence[Message]) -> list[bytes]:
    """State hashes of every prefix: `[root, after m0, after m1, ...]`; linear in the input size."""
    return [context.root_hash, *chain_from(context.root_hash, messages)]


def chain_from(state: bytes, messages: Sequence[Message]) -> list[bytes]:
    """The state hash after each of `messages`, starting from `state`."""
    states = []
    for message in messages:
        state = chain(state, message)
        states.append(state)
    return states


def canonical_arguments(arguments: Any, param: str) -> str:
    """Tool-call arguments as sorted compact JSON; text that is not JSON is kept verbatim."""
    if isinstance(arguments, str):
        return _canonical_json_text(arguments)
    if isinstance(arguments, Mapping):
        return _compact(arguments)
    raise CanonicalError("tool-call arguments must be a JSON string or an object", param)


@functools.lru_cache(maxsize=8192)
def _canonical_json_text(text: str) -> str:
    """Replayed histories resend the same argument texts every turn: canonicalize each once. orjson reads and writes
    a text without floats (every float literal has a digit before `.`, `e` or `E`; the two write floats differently)
    nor 19-digit runs exactly as the standard library (sorted keys compare alike in UTF-8); what it refuses (NaN,
    lone surrogates, deep nesting, not JSON) goes to the standard library."""
    if _FLOAT_HINT(text) is None and _LONG_DIGITS(text) is None:
        try:
            return orjson.dumps(orjson.loads(text), option=orjson.OPT_SORT_KEYS).decode()
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):
            pass
    try:
        return _compact(json.loads(text))
    except ValueError:
        return text


def text_of(content: Any, param: str) -> str | None:
    """Concatenate a string or a list of text parts; None when absent. Image parts are refused here."""
    text, images = content_of(content, param)
    if images:
        raise CanonicalError("images are accepted only in user and tool message content", images[0].param)
    return text


def content_of(content: Any, param: str) -> tuple[str | None, tuple[Image, ...]]:
    """The text of a string or a list of text and image parts, and its images at their text offsets."""
    if content is None or isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise CanonicalError("content must be a string or a list of content parts", param)
    texts: list[str] = []
    images: list[Image] = []
    offset = 0
    for j, part in enumerate(content):
        piece = _part(part, f"{param}[{j}]", offset)
        if isinstance(piece, Image):
            images.append(piece)
        else:
            texts.append(piece)
            offset += len(piece)
    return "".join(texts), tuple(images)


def _part(part: Any, param: str, offset: int) -> str | Image:
    if not isinstance(part, Mapping):
        raise CanonicalError("a content part must be an object with a 'type'", param)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "input_image"):
        return image_of(part.get("image_url"), offset, param)
    raise CanonicalError(f"unsupported content part type {kind!r}; send text or image_url parts", param)


def image_of(raw: Any, offset: int, param: str) -> Image:
    """An image from the `image_url` of part `param`: a URL string or an `{"url": ...}` object."""
    url = raw.get("url") if isinstance(raw, Mapping) else raw
    if not isinstance(url, str) or not url.startswith(IMAGE_URL_PREFIXES):
        where = f"{param}.image_url" + (".url" if isinstance(raw, Mapping) else "")
        raise CanonicalError("an image needs a URL: a data: URI (base64) or an http(s) URL", where)
    return Image(url, offset, _url_digest(url), param)


@functools.lru_cache(maxsize=256)
def _url_digest(url: str) -> bytes:
    """Digest of an image URL; retried requests in other sessions resend the same URLs."""
    return digest(url.encode())


def make_message(
    role: Any,
    content: str | None,
    param: str,
    reasoning: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    tool_call_id: str | None = None,
    images: tuple[Image, ...] = (),
) -> Message:
    """Build a validated canonical message; `param` is the message's field path."""
    if role not in ROLES:
        raise CanonicalError(f"role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    if images:
        return _with_images(role, content or "", param, images, tool_call_id)
    if role == "assistant":
        if not content and not tool_calls and not reasoning and content != "":
            raise CanonicalError("assistant message needs content, tool_calls or reasoning", f"{param}.content")
        return Message("assistant", content or "", reasoning or None, tool_calls)
    if role == "tool":  # a tool that printed nothing is common (openai-agents, LangChain send "")
        return Message("tool", content or "", tool_call_id=tool_call_id)
    if not content:
        raise CanonicalError(f"{role} message content must be non-empty text", f"{param}.content")
    return Message(role, content)


def _with_images(role: str, content: str, param: str, images: tuple[Image, ...], call_id: str | None) -> Message:
    if role not in IMAGE_ROLES:
        raise CanonicalError(f"images are accepted in user and tool messages, not in {role} messages",
                             images[0].param or f"{param}.content")
    return Message(role, content, tool_call_id=call_id if role == "tool" else None, images=images)  # type: ignore[arg-type]


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


# --- OpenAI Chat message objects ----------------------------------------------------------------


def parse_messages(raw: Any, param: str = "messages") -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise CanonicalError("messages must be a non-empty list", param)
    return tuple(parse_message(m, f"{param}[{i}]") for i, m in enumerate(raw))


def parse_message(raw: Any, param: str) -> Message:
    if not isinstance(raw, Mapping):
        raise CanonicalError("a message must be an object with 'role' and 'content'", param)
    role, content = raw.get("role"), raw.get("content")
    if type(content) is str and raw.keys() <= _PLAIN_KEYS:  # the common cases, as `make_message` builds them
        if role == "tool":
            call_id = raw.get("tool_call_id")
            return Message("tool", content, tool_call_id=call_id if isinstance(call_id, str) else None)
        if role in _PLAIN_ROLES and content:
            return Message(role, content)
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


_PLAIN_ROLES = frozenset({"system", "user"})
_PLAIN_KEYS = frozenset({"role", "content", "name", "tool_call_id"})
"""A system or user message with only these keys and non-empty text content is `Message(role, content)`, a tool
message with text content `Message("tool", content, tool_call_id=...)` (`name` is dropped like every unknown field,
and only a tool message keeps its `tool_call_id`)."""


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
