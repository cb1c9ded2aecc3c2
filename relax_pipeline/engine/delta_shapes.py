"""DeltaShapes: observation deltas rendered once per shape, then filled in by string joins.

A later turn's delta is the chat template's text after an anchor assistant turn for the new messages
(`template.py`). Those are nearly always observations (tool results, user messages) whose only varying
parts are their contents and tool-call ids, and a Jinja render costs far more than the tokenization of
the few hundred characters it produces. So for each shape (context, roles, which messages carry a
tool-call id) the template is rendered once with a sentinel in every varying slot; the text between
the sentinels is kept, and a later delta of that shape is the kept pieces joined with its own values.

This is exact only for templates that copy these values into the output without looking at them. Two
guards keep it exact, and every doubt falls back to a real render:

- per shape, once: the filled skeleton must equal a real render for probe values that make templates
  which look at contents render differently (surrounding whitespace for `trim`, empty text, tool-
  response and think wrappers, Jinja syntax); a shape that fails any probe is always rendered;
- per shape, once, then per request: every string literal of the template source and every special
  token is tried as the value too; those under which the render differs from the filled skeleton (the
  template tests for them: `'</think>' in content`, `content.startswith('<tool_response>')`) are the
  shape's markers, and a request whose values contain one is rendered.

Assistant messages, reasoning, tool calls and images are always rendered. A tokenizer without a parsable
template string gets no shortcut. This module does not tokenize and knows nothing about sessions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes

from relax_pipeline.canonical.form import Context, Message

SLOT = "\u2063relax-slot-"
_SLOTS = re.compile(f"{SLOT}([ct])(\\d+)\u2063")
PROBES = ("  padded text  ", "\nnewlines\n", "", "<tool_response>\nr\n</tool_response>", "<think>\nr\n</think>\n\nx",
          "ünï {{ x }} {% if y %}")
"""Values under which a template that looks at contents or ids renders differently from the skeleton."""
MAX_SHAPES = 512

Tail = Callable[[list[dict[str, Any]], Context, bool], str]
"""Renders new messages after the anchor: (template dicts, context, whether tools are rendered) → text."""
ShapeKey = tuple[bytes, bool, tuple[tuple[str, bool], ...]]


@dataclass(frozen=True)
class Skeleton:
    """A delta render with its varying slots cut out: `pieces` around `slots`, one more piece than slots."""

    pieces: tuple[str, ...]
    slots: tuple[tuple[str, int], ...]
    """("c", i): the content of new message i; ("t", i): its tool-call id."""
    markers: tuple[str, ...] = (SLOT,)
    """Substrings of a value that need a real render (the template reacts to them)."""

    @classmethod
    def parse(cls, text: str) -> Skeleton:
        parts = _SLOTS.split(text)
        return cls(tuple(parts[0::3]), tuple((kind, int(i)) for kind, i in zip(parts[1::3], parts[2::3], strict=True)))

    def takes(self, messages: Sequence[Message]) -> bool:
        """Whether no value of `messages` holds a marker."""
        return not any(marker in value for m in messages for value in (m.content, m.tool_call_id or "")
                       for marker in self.markers)

    def fill(self, messages: Sequence[Message]) -> str:
        out = [self.pieces[0]]
        for (kind, i), piece in zip(self.slots, self.pieces[1:], strict=True):
            out += (messages[i].content if kind == "c" else messages[i].tool_call_id or "", piece)
        return "".join(out)


class DeltaShapes:
    """Skeletons of observation deltas by shape (see the module); `render` gives None where it cannot."""

    def __init__(self, tail: Tail, tokenizer: Any) -> None:
        self._tail = tail
        self._literals = literals(tokenizer)
        self._skeletons: dict[ShapeKey, Skeleton | None] = {}

    def render(self, messages: Sequence[Message], context: Context, tools: bool) -> str | None:
        """The delta text of `messages`, or None when they must be rendered by the template."""
        if self._literals is None or not all(_observation(m) for m in messages):
            return None
        key = (context.root_hash, tools, tuple((m.role, m.tool_call_id is not None) for m in messages))
        if key not in self._skeletons:
            if len(self._skeletons) >= MAX_SHAPES:
                del self._skeletons[next(iter(self._skeletons))]
            self._skeletons[key] = self._build(messages, context, tools)
        skeleton = self._skeletons[key]
        return skeleton.fill(messages) if skeleton is not None and skeleton.takes(messages) else None

    def _build(self, messages: Sequence[Message], context: Context, tools: bool) -> Skeleton | None:
        """Render the shape with sentinels; check it on every probe; its markers are the literals it fails."""
        try:
            skeleton = Skeleton.parse(self._render(_valued(messages, lambda kind, i: f"{SLOT}{kind}{i}\u2063"),
                                                   context, tools))
            if not all(self._agrees(skeleton, messages, probe, context, tools) for probe in PROBES):
                return None
            live = [t for t in self._literals or () if not self._agrees(skeleton, messages, t, context, tools)]
        except Exception:  # noqa: BLE001 - a template that fails on probes is simply always rendered
            return None
        return dataclasses.replace(skeleton, markers=(*live, SLOT))

    def _agrees(self, skeleton: Skeleton, messages: Sequence[Message], probe: str, context: Context,
                tools: bool) -> bool:
        """Whether the skeleton filled with `probe` as every value is the template's render."""
        probed = _valued(messages, lambda kind, i: probe)
        return skeleton.fill(probed) == self._render(probed, context, tools)

    def _render(self, messages: Sequence[Message], context: Context, tools: bool) -> str:
        return self._tail([m.to_template() for m in messages], context, tools)


def _observation(message: Message) -> bool:
    """A message whose only varying parts are its content and tool-call id."""
    return (message.role != "assistant" and not message.images and not message.tool_calls
            and message.reasoning_content is None)


def _valued(messages: Sequence[Message], value: Callable[[str, int], str]) -> list[Message]:
    """`messages` with contents and tool-call ids replaced by `value(kind, index)`."""
    return [dataclasses.replace(m, content=value("c", i),
                                tool_call_id=None if m.tool_call_id is None else value("t", i))
            for i, m in enumerate(messages)]


def literals(tokenizer: Any) -> tuple[str, ...] | None:
    """The template's string literals (also stripped) and the special tokens; None: no usable template."""
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):
        return None
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateError:
        return None
    found = {n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)}
    found |= {t.strip() for t in found} | {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    return tuple(sorted(found - {""}))
