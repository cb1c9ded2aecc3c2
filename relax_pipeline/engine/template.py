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
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import orjson
from jinja2 import nodes

from relax_pipeline.canonical.form import TEXT_ONLY_MESSAGE, CanonicalError, Context, Message, digest
from relax_pipeline.engine.words import Encode, Words

if TYPE_CHECKING:
    from relax_pipeline.engine.vision import Vision

ANCHOR_USER = "\u2063relax-anchor-user\u2063"
ANCHOR_ASSISTANT = "\u2063relax-anchor-assistant\u2063"
_ANCHOR = [{"role": "user", "content": ANCHOR_USER}, {"role": "assistant", "content": ANCHOR_ASSISTANT}]
log = logging.getLogger(__name__)


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
        self.vision: Vision | None = None
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
        dicts = [m.to_template() for m in messages]
        try:
            key = digest(orjson.dumps([dicts, context.tools, context.template_kwargs]))
        except TypeError:  # what orjson refuses (big ints, non-string keys): no reuse
            key = None
        if (known := self._prompts.get(key)) is not None:
            return known.tolist()
        ids = self.encode(self._render(dicts, context, True), keep=True)
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


# --- fast paths: the compiled template and the Rust tokenizer -----------------------------------

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
        self._compiled = _compile(tokenizer)
        self._variables = dict(getattr(tokenizer, "special_tokens_map", {}) or {})
        if self._compiled is not None and not self._agrees():
            log.info("compiled chat template differs from apply_chat_template; using the slow path")
            self._compiled = None

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        if self._compiled is None:
            return self._slow(messages, tools, generation_prompt, kwargs)
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
        by_words = self.words.encode if self.words is not None else None  # a piece's ids: by its words where exact
        self.pieces = Pieces.of(tokenizer, self._encode, by_words) if self._backend is not None else None

    def encode(self, text: str, keep: bool = False) -> list[int]:
        """Token ids of `text`; `keep`: remember its pieces for later texts (a first prompt's: `Pieces`)."""
        return self._encode(text) if self.pieces is None else self.pieces.encode(text, keep)

    def _encode(self, text: str) -> list[int]:
        if self._backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self._fast:  # the same ids without computing character offsets (about 30% less CPU per delta)
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is None:
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return self._backend.decode(list(ids), skip_special_tokens=False)

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
                 piece: Encode | None = None) -> None:
        self._added = added
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")").split
        self._encode = encode
        self._piece_ids = piece or encode  # a piece's ids (`Words.encode` where exact); `encode`: whole texts
        self.kept = Kept(budget, by_key=True)

    @classmethod
    def of(cls, tokenizer: Any, encode: Encode, piece: Encode | None = None) -> Pieces | None:
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
        for i, part in enumerate(self._split(text)):
            if i & 1:
                ids.append(self._added[part])
            elif part:
                ids += self._piece(part, keep)
        return ids

    def _piece(self, piece: str, keep: bool) -> Sequence[int]:
        if (known := self.kept.get(piece)) is not None:
            return known
        ids = self._piece_ids(piece)
        if keep:
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


def _alias(message: dict[str, Any]) -> dict[str, Any]:
    """The reasoning aliases Hugging Face adds (`thinking` for templates that read that name)."""
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message}
