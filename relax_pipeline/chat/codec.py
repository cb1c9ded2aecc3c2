"""Fast paths of the chat template: the compiled template, the Rust tokenizer, and the kept ids of pieces and prompts.

Fast paths (`Renderer`, `Codec`): `apply_chat_template` and `tokenizer.encode` carry per-call overhead
larger than the work of a one-message delta, so the compiled template and the Rust tokenizer are called
directly, but only after checking once at start that they give exactly what the Hugging Face calls give on
a probe conversation; any mismatch or a missing internal falls back to the Hugging Face calls.

Kept ids (`Pieces`, `Kept`): a Hugging Face tokenizer cuts a text at its added tokens (`<|im_end|>`, ...) before
anything else and encodes each piece between them on its own, so a text's ids are its pieces' ids joined with the
added tokens' ids. The pieces of first prompts are kept (an LRU in characters), so what sessions share (a system
prompt, tool definitions, a group's replayed history, the template's `assistant\n`) is tokenized once. Used only
where that is exact: added tokens matched as plain strings (no lstrip/rstrip/single_word, none normalized under a
normalizer) and pieces encoded alike wherever they stand (checked on probes against whole-text encodes). The ids
of whole first prompts are kept too, by a digest of the render's inputs (message dicts, tools in their order,
kwargs), so the sessions of a group, which send the same first request, pay for one render.


Sandbox shortcuts (`_Checks`): the compiled template runs in an overlay of Jinja's immutable sandbox whose checks
give the same answers with less work: a plain dict's attribute that no dict has (`message.role`) is read as its
item without raising AttributeError first; the safety of an attribute of a builtin value (str, dict, list, ...) is
decided once per (type, name), since the sandbox decides it from the name and `isinstance` checks against
concrete types and ABCs only (remembered decisions are dropped whenever an ABC registers a class); builtin
functions and methods, which cannot carry the `unsafe_callable`/`alters_data` marks, are callable. A template
whose environment is anything else runs as compiled.

This module does not know about messages or sessions (`template.py` does).
"""

from __future__ import annotations

import abc
import logging
import re
import types
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment
from jinja2.utils import Namespace

from relax_pipeline.chat.words import Encode, Words

log = logging.getLogger(__name__)

PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "d",
                                                  "parameters": {"type": "object", "properties": {}}}}]
PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}]},
    {"role": "tool", "tool_call_id": "c", "content": "t"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "v ünï"},
]


class Renderer:
    """Renders message dicts with the tokenizer's chat template, compiled once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._variables = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        self._checks: _Checks | None = None
        self._compiled = None
        compiled = _compile(tokenizer)
        candidates = (_with_checks(compiled, tokenizer.chat_template), (compiled, None)) if compiled else ()
        for self._compiled, self._checks in candidates:  # noqa: B007 - the first that agrees is kept
            if self._compiled is not None and self._agrees():
                return
        if compiled is not None:
            log.info("compiled chat template differs from apply_chat_template; using the slow path")
        self._compiled = None

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if self._compiled is None:
            return self._slow(messages, tools, generation_prompt, kwargs)
        if self._checks is not None:
            self._checks.refresh()
        return self._compiled.render(messages=[_alias(m) for m in messages], tools=tools, documents=None,
                                     add_generation_prompt=generation_prompt, **self._variables, **kwargs)

    def _slow(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **kwargs)

    def _agrees(self) -> bool:
        try:
            return all(self(PROBE, tools, True, {}) == self._slow(PROBE, tools, True, {})
                       for tools in (PROBE_TOOLS, None))
        except Exception:  # noqa: BLE001 - any failure means: do not use the shortcut
            return False


class Codec:
    """Encodes without special tokens and decodes with them, through the Rust tokenizer when it agrees; `encode`
    takes the ids of known pieces between added tokens from `Pieces` where that is exact for the tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is not None and not self._agrees():
            self._backend = None
        self._fast = self._backend is not None and hasattr(self._backend, "encode_batch_fast")
        self.words = Words.of(self._backend, self._encode) if self._backend is not None else None  # None: not exact
        by_words = self.words.ids if self.words is not None else None  # a piece's ids: by its words where exact
        self.pieces = Pieces.of(tokenizer, self._encode, by_words) if self._backend is not None else None

    def encode(self, text: str, keep: bool = False) -> list[int]:
        """Token ids of `text`; `keep`: remember its pieces for later texts (a first prompt's: `Pieces`)."""
        return self._encode(text) if self.pieces is None else self.pieces.encode(text, keep)

    def encode_array(self, text: str, keep: bool = False) -> array:
        """`encode` as an array of C ints."""
        return array("i", self._encode(text)) if self.pieces is None else self.pieces.encode_array(text, keep)

    def _encode(self, text: str) -> list[int]:
        if self._backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self._fast:  # the same ids without computing character offsets (about 30% less CPU per delta)
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return self._backend.decode(ids if type(ids) is list else list(ids), skip_special_tokens=False)

    def _agrees(self) -> bool:
        text = "".join(str(m.get("content", "")) for m in PROBE) + " hello\n\n  world <|im_end|>\n{\"a\": 1}"
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            backend_ids = self._backend.encode(text, add_special_tokens=False).ids
            slow_text = self.tokenizer.decode(ids, skip_special_tokens=False)
            return ids == backend_ids and slow_text == self._backend.decode(ids, skip_special_tokens=False)
        except Exception:  # noqa: BLE001
            return False


PROMPT_CACHE_TOKENS = 1 << 20  # tokens of first prompts `ChatTemplate.prompt_ids` keeps: 1 Mi, 4 MiB


class Kept:
    """Token ids by key, least recently used out first once the keys' (`by_key`) or the ids' lengths pass `budget`."""

    def __init__(self, budget: int, by_key: bool = False) -> None:
        self._kept: OrderedDict[Any, array] = OrderedDict()
        self._size = 0
        self.budget = budget
        self.by_key = by_key

    def get(self, key: Any) -> array | None:
        if (known := self._kept.get(key)) is not None:
            self._kept.move_to_end(key)
        return known

    def put(self, key: Any, ids: Sequence[int]) -> None:
        """Keep a copy of `ids` (an array's is one memory copy)."""
        self._kept[key] = array("i", ids)
        self._size += len(key if self.by_key else ids)
        while self._size > self.budget:
            old, dropped = self._kept.popitem(last=False)
            self._size -= len(old if self.by_key else dropped)


PIECE_CACHE_CHARS = 1 << 22  # characters of pieces `Pieces` keeps: 4 Mi (about 10 MiB), dozens of long prompts
PIECE_PROBES = ("", "a", " a", "\n\nx ", "  x  \n", "ünï 12", "{\"a\": [1, 2]}", "\t<x>")


class Pieces:
    """Ids of texts by their pieces between added tokens, the ids of pieces seen before kept (see the module)."""

    def __init__(self, added: dict[str, int], encode: Encode, budget: int = PIECE_CACHE_CHARS,
                 piece: Callable[[str], Sequence[int]] | None = None) -> None:
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")").split
        self._encode = encode
        self._piece_ids = piece or encode  # a piece's ids (`Words.encode` where exact); `encode`: whole texts
        self.kept = Kept(budget, by_key=True)

    @classmethod
    def of(cls, tokenizer: Any, encode: Encode, piece: Callable[[str], Sequence[int]] | None = None) -> Pieces | None:
        """The cache for `tokenizer`, or None where cutting at its added tokens is not exact (`piece`: `__init__`)."""
        try:
            tokens = dict(tokenizer.added_tokens_decoder)
            normalizer = tokenizer.backend_tokenizer.normalizer
        except AttributeError:
            return None
        if not tokens or any(t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizer is not None)
                             for t in tokens.values()):
            return None
        pieces = cls({t.content: i for i, t in tokens.items()}, encode, piece=piece)
        return pieces if pieces._agrees() else None

    def encode(self, text: str, keep: bool = False) -> list[int]:
        """The ids of `text`; `keep`: remember the pieces not known yet."""
        ids: list[int] = []
        self._join(text, keep, ids)
        return ids

    def encode_array(self, text: str, keep: bool = False) -> array:
        """`encode` as an array of C ints (kept pieces copied into it whole)."""
        ids = array("i")
        self._join(text, keep, ids)
        return ids

    def _join(self, text: str, keep: bool, out: list[int] | array) -> None:
        append, extend = out.append, out.extend
        for i, part in enumerate(self._split(text)):
            if i & 1:
                append(self._added[part])
            elif part:
                extend(self._piece(part, keep))

    def _piece(self, piece: str, keep: bool) -> Sequence[int]:
        if (known := self.kept.get(piece)) is not None:
            return known
        if not keep:
            return self._piece_ids(piece)
        ids = array("i", self._piece_ids(piece))
        self.kept.put(piece, ids)
        return ids

    def _agrees(self) -> bool:
        texts = [a + t + b for t in self._added for a in PIECE_PROBES for b in PIECE_PROBES[:4]]
        texts.append("".join(self._added) + PIECE_PROBES[-1].join(self._added))
        try:
            return all(self.encode(text) == self._encode(text) for text in texts)
        except Exception:  # noqa: BLE001 - any failure means: encode whole texts
            return False


def _compile(tokenizer: Any) -> Any:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template)
    except Exception:  # noqa: BLE001 - an internal that moved: use the public path
        return None


_PLAIN = frozenset({str, dict, list, tuple, int, float, bool, type(None), LoopContext})
"""Types whose attributes' safety the sandbox decides from the type and the name alone (builtins, Jinja's `loop`;
and `_by_type` adds namespaces)."""
_DICT_NAMES = frozenset(dir(dict))
"""Every attribute a plain dict has (it has no instance attributes)."""
_BUILTIN_CALLABLES = frozenset({types.BuiltinFunctionType, types.MethodWrapperType, types.MethodDescriptorType,
                                types.WrapperDescriptorType, types.ClassMethodDescriptorType})
"""Callables that cannot carry attributes, so never the sandbox's `unsafe_callable`/`alters_data` marks."""


class _Checks:
    """The immutable sandbox's checks with exact shortcuts (see the module), installed on an overlay environment."""

    def __init__(self, env: ImmutableSandboxedEnvironment) -> None:
        self._env = env
        self._safe: dict[tuple[type, str], bool] = {}
        self._by_type: dict[type, bool] = {}
        self._token = abc.get_cache_token()
        env.getattr = self.getattr  # type: ignore[method-assign]
        env.is_safe_attribute = self.is_safe_attribute  # type: ignore[method-assign]
        env.is_safe_callable = self.is_safe_callable  # type: ignore[method-assign]

    def refresh(self) -> None:
        """Forget the decisions once any ABC has registered a class since they were made."""
        if (token := abc.get_cache_token()) != self._token:
            self._safe.clear()
            self._token = token

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_NAMES:
            try:  # what the sandbox does once `getattr` has raised AttributeError
                return obj[attribute]
            except (TypeError, LookupError):
                return self._env.undefined(obj=obj, name=attribute)
        return SandboxedEnvironment.getattr(self._env, obj, attribute)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if type(attr) is not str or not (kind in _PLAIN or self._by_type.get(kind) or self._learn(kind)):
            return ImmutableSandboxedEnvironment.is_safe_attribute(self._env, obj, attr, value)
        if (known := self._safe.get((kind, attr))) is None:
            known = self._safe[kind, attr] = ImmutableSandboxedEnvironment.is_safe_attribute(self._env, obj, attr,
                                                                                             value)
        return known

    def _learn(self, kind: type) -> bool:
        """Whether `kind` is a namespace (Jinja's or a subclass, as Hugging Face's) whose `__class__`, which the
        sandbox's ABC checks read, is its type: then it is decided by type, like `_PLAIN`."""
        if kind not in self._by_type:
            self._by_type[kind] = (issubclass(kind, Namespace) and kind.__getattribute__ is Namespace.__getattribute__
                                   and all("__class__" not in vars(k) for k in kind.__mro__[:-1]))
        return self._by_type[kind]

    def is_safe_callable(self, obj: Any) -> bool:
        return type(obj) in _BUILTIN_CALLABLES or SandboxedEnvironment.is_safe_callable(self._env, obj)


def _with_checks(template: Any, source: str) -> tuple[Any, _Checks | None]:
    """`source` compiled again in an overlay of `template`'s environment with `_Checks`; (None, None) where that
    environment is not exactly Jinja's immutable sandbox."""
    env = getattr(template, "environment", None)
    if type(env) is not ImmutableSandboxedEnvironment:
        return None, None
    try:
        overlay = env.overlay()
        checks = _Checks(overlay)
        return overlay.from_string(source), checks
    except Exception:  # noqa: BLE001 - an environment that cannot be overlaid: the template as compiled
        return None, None


def _alias(message: dict[str, Any]) -> dict[str, Any]:
    """The reasoning aliases Hugging Face adds (`thinking` for templates that read that name)."""
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message}
