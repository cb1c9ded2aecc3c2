"""Chat-template compiler: full renders for first turns, observation deltas for every later turn.

The first turn of a conversation renders the whole request with the generation prompt and tokenizes
it. A later turn never re-renders or re-tokenizes history: it renders a fixed two-message anchor
(`user`, `assistant`) followed by the new messages, cuts the text right after the anchor assistant's
content, and tokenizes only what follows: the template's glue after an assistant turn, the new messages
and the next generation prompt. The cut text starts with the template's end-of-turn marker; when the
previous response already ended with it (the usual case) that marker is dropped, otherwise (a response
cut by the length limit or a stop string) it is kept, so the turn is closed the way the template
renders it, with loss 0.

Deltas of plain observations (`DeltaShapes`: tool results, user messages, whose only varying parts are
their contents and tool-call ids) are rendered once per shape (context, roles, which messages carry a
tool-call id) with a sentinel in every varying slot, and later deltas of that shape are the kept pieces
joined with their own values, so a turn pays for no Jinja render. Two guards keep this exact, and every
doubt falls back to a real render: per shape, once, the filled skeleton must equal a real render for probe
values that make templates which look at contents render differently (whitespace for `trim`, empty text,
tool-response and think wrappers, Jinja syntax); and every string literal of the template source and every
special token is tried as a value, those under which the render differs (`'</think>' in content`) becoming
the shape's markers, so a request whose values contain one is rendered. Assistant messages, reasoning, tool
calls and images are always rendered; a tokenizer without a parsable template string gets no shortcut.

Fast paths (`Renderer`, `Codec`, the kept ids of pieces and prompts: `Pieces`, `Kept`) live in `codec.py`.

Images render as `{"type": "image"}` content parts (`Message.to_template`), which a vision-language
template writes as one unexpanded placeholder (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`).
`vision` is the model's image processor (bound by the turn service from its engine; None for text-only
models, which refuse images in `check_media`).

Templates that rewrite history (for example dropping earlier reasoning) make a sample differ from a
full render of the final conversation; `render_differences` reports where, it does not hide it.
This module does not parse model output (`parsers.py`) and does not know about sessions.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jinja2
import orjson
from jinja2 import nodes

from relax_pipeline.canonical.form import TEXT_ONLY_MESSAGE, CanonicalError, Context, Image, Message, digest
from relax_pipeline.chat.codec import PROMPT_CACHE_TOKENS, Codec, Kept, Pieces, Renderer


class _Features(Protocol):
    tokens: int


class ImageTokens(Protocol):
    """What the template needs of a model's image processor (`engine/vision.py`'s `Vision` is one): how many
    tokens an image's placeholder expands to."""

    def features(self, image: Image) -> _Features: ...


ANCHOR_USER = "\u2063relax-anchor-user\u2063"
ANCHOR_ASSISTANT = "\u2063relax-anchor-assistant\u2063"
_ANCHOR = [{"role": "user", "content": ANCHOR_USER}, {"role": "assistant", "content": ANCHOR_ASSISTANT}]
__all__ = ["ChatTemplate", "Codec", "DeltaShapes", "Pieces", "RenderDifference", "Skeleton", "literals"]


@dataclass(frozen=True)
class RenderDifference:
    """Where a sample's decoded tokens and a full render of its conversation first differ."""

    offset: int
    sample_text: str
    render_text: str


class ChatTemplate:
    """Renders and tokenizes conversations with a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any, end_of_turn: str | None = None) -> None:
        self.tokenizer = tokenizer
        self._renderer = Renderer(tokenizer)
        self.codec = Codec(tokenizer)
        self._tools_matter: dict[bytes, bool] = {}
        self._shapes = DeltaShapes(self._tail, tokenizer)
        self.end_of_turn = end_of_turn or self._detect_end_of_turn()
        self.end_of_turn_ids = tuple(self.encode(self.end_of_turn))
        self.vision: ImageTokens | None = None
        """The model's image processor when it sees images, else None."""
        self._prompts = Kept(PROMPT_CACHE_TOKENS)

    def render(self, messages: Sequence[Message], context: Context, generation_prompt: bool) -> str:
        """Full-render text of a conversation (used by first turns, checks and tests)."""
        return self._render([m.to_template() for m in messages], context, generation_prompt)

    def _render(
        self, messages: list[dict[str, Any]], context: Context, generation_prompt: bool, tools: bool = True
    ) -> str:
        return self._renderer(messages, context.template_tools() if tools else None, generation_prompt,
                              context.kwargs())

    def encode(self, text: str, keep: bool = False) -> list[int]:
        """Token ids of `text` (no special tokens added); `keep`: remember its pieces (`Pieces`)."""
        return self.codec.encode(text, keep)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def prompt_ids(self, messages: Sequence[Message], context: Context) -> list[int]:
        """Token ids of a first turn: the full render with the generation prompt, kept by a digest of everything
        the template reads (see the module), its pieces kept too (`Pieces`)."""
        return self.prompt_array(messages, context).tolist()

    def prompt_array(self, messages: Sequence[Message], context: Context) -> array:
        """`prompt_ids` as a fresh array of C ints (what the forest stores; no Python int per token)."""
        dicts = [m.to_template() for m in messages]
        try:
            key = digest(orjson.dumps([dicts, context.tools, context.template_kwargs]))
        except TypeError:  # what orjson refuses (big ints, non-string keys): no reuse
            key = None
        if (known := self._prompts.get(key)) is not None:
            return array("i", known)
        ids = self.codec.encode_array(self._render(dicts, context, True), keep=True)
        if key is not None:
            self._prompts.put(key, ids)
        return ids

    def check_media(self, messages: Sequence[Message], start: int = 0) -> None:
        """A text-only model refuses the first image with a 400 naming its field (`messages[start]` is the
        request's message `start`)."""
        if self.vision is not None:
            return
        for i, message in enumerate(messages):
            if message.images:
                raise CanonicalError(TEXT_ONLY_MESSAGE, message.images[0].param or f"messages[{start + i}].content")

    def prompt_length(self, messages: Sequence[Message], context: Context) -> int:
        """Tokens of a first-turn prompt as the model sees it (image placeholders expanded)."""
        self.check_media(messages)
        length = len(self.prompt_ids(messages, context))
        if self.vision is not None:
            length += sum(self.vision.features(i).tokens - 1 for m in messages for i in m.images)
        return length

    def delta_ids(self, messages: Sequence[Message], context: Context, previous_ended_turn: bool) -> list[int]:
        """Token ids that follow a committed assistant turn: glue, new messages, generation prompt."""
        return self.encode(self.delta_text(messages, context, previous_ended_turn))

    def delta_array(self, messages: Sequence[Message], context: Context, previous_ended_turn: bool) -> array:
        """`delta_ids` as an array of C ints (what the forest stores; kept pieces and words copied in whole)."""
        return self.codec.encode_array(self.delta_text(messages, context, previous_ended_turn))

    def delta_text(self, messages: Sequence[Message], context: Context, previous_ended_turn: bool) -> str:
        tools = self._need_tools(context)
        tail = self._shapes.render(messages, context, tools)
        if tail is None:
            tail = self._tail([m.to_template() for m in messages], context, tools)
        if not tail.startswith(self.end_of_turn):
            raise ValueError(f"chat template does not close an assistant turn with {self.end_of_turn!r}")
        return tail[len(self.end_of_turn) :] if previous_ended_turn else tail

    def _tail(self, messages: list[dict[str, Any]], context: Context, tools: bool) -> str:
        """What the template writes after the anchor assistant's content, for these new messages."""
        text = self._render(_ANCHOR + messages, context, True, tools)
        return text[text.index(ANCHOR_ASSISTANT) + len(ANCHOR_ASSISTANT) :]

    def _need_tools(self, context: Context) -> bool:
        """Whether this context's tools change delta renders (checked once per context on a probe)."""
        if not context.tools:
            return False
        key = context.root_hash
        if key not in self._tools_matter:
            probe = [{"role": "tool", "tool_call_id": "c", "content": "t"}, {"role": "user", "content": "u"}]
            self._tools_matter[key] = self._tail(probe, context, True) != self._tail(probe, context, False)
        return self._tools_matter[key]

    def _detect_end_of_turn(self) -> str:
        """The special token the template writes right after an assistant message's content."""
        text = self._render(list(_ANCHOR), Context(), generation_prompt=False)
        tail = text[text.index(ANCHOR_ASSISTANT) + len(ANCHOR_ASSISTANT) :]
        for token in sorted(self.tokenizer.all_special_tokens, key=len, reverse=True):
            if tail.startswith(token):
                return token
        eos = self.tokenizer.eos_token
        if eos and tail.startswith(eos):
            return eos
        raise ValueError("cannot find the chat template's end-of-turn token; set model.end_of_turn")

    def render_differences(self, token_ids: Sequence[int], messages: Sequence[Message], context: Context
                           ) -> RenderDifference | None:
        """Compare a sample's decoded tokens with the full render of its final conversation."""
        sample = self.decode(token_ids)
        render = self.render(messages, context, generation_prompt=False)
        if sample == render or render.startswith(sample) and render[len(sample) :].strip() == "":
            return None
        offset = _first_difference(sample, render)
        return RenderDifference(offset, sample[offset : offset + 80], render[offset : offset + 80])


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


# --- observation deltas by shape ---------------------------------------------------------------

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
        search = self._any_marker
        return not any(search(m.content) or m.tool_call_id and search(m.tool_call_id) for m in messages)

    @functools.cached_property
    def _any_marker(self) -> Callable[[str], re.Match[str] | None]:
        """Search for any marker in one pass (a literal alternation: found wherever one of them is a substring)."""
        return re.compile("|".join(map(re.escape, self.markers))).search

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
