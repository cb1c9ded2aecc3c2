"""Chat-template compiler: full renders for first turns, observation deltas for every later turn.

The first turn of a conversation renders the whole request with the generation prompt and tokenizes
it. A later turn never re-renders or re-tokenizes history: it renders a fixed two-message anchor
(`user`, `assistant`) followed by the new messages, cuts the text right after the anchor assistant's
content, and tokenizes only what follows: the template's glue after an assistant turn, the new messages
and the next generation prompt. The cut text starts with the template's end-of-turn marker; when the
previous response already ended with it (the usual case) that marker is dropped, otherwise (a response
cut by the length limit or a stop string) it is kept, so the turn is closed the way the template
renders it, with loss 0. Deltas of plain observations (tool results, user messages) are rendered once
per shape and then filled in (`delta_shapes.py`, exact by its probes and markers), so a turn pays for
no Jinja render.

Images render as `{"type": "image"}` content parts (`Message.to_template`), which a vision-language
template writes as one unexpanded placeholder (Qwen2-VL: `<|vision_start|><|image_pad|><|vision_end|>`).
`vision` is the model's image processor (bound by the turn service from its engine; None for text-only
models, which refuse images in `check_media`).

Templates that rewrite history (for example dropping earlier reasoning) make a sample differ from a
full render of the final conversation; `render_differences` reports where, it does not hide it.
This module does not parse model output (`parsers.py`) and does not know about sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_pipeline.canonical.form import TEXT_ONLY_MESSAGE, CanonicalError, Context, Message
from relax_pipeline.engine.delta_shapes import DeltaShapes
from relax_pipeline.engine.render import Codec, Renderer

if TYPE_CHECKING:
    from relax_pipeline.engine.vision import Vision

ANCHOR_USER = "\u2063relax-anchor-user\u2063"
ANCHOR_ASSISTANT = "\u2063relax-anchor-assistant\u2063"
_ANCHOR = [{"role": "user", "content": ANCHOR_USER}, {"role": "assistant", "content": ANCHOR_ASSISTANT}]


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

    def render(self, messages: Sequence[Message], context: Context, generation_prompt: bool) -> str:
        """Full-render text of a conversation (used by first turns, checks and tests)."""
        return self._render([m.to_template() for m in messages], context, generation_prompt)

    def _render(
        self, messages: list[dict[str, Any]], context: Context, generation_prompt: bool, tools: bool = True
    ) -> str:
        return self._renderer(messages, context.template_tools() if tools else None, generation_prompt,
                              context.kwargs())

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def prompt_ids(self, messages: Sequence[Message], context: Context) -> list[int]:
        """Token ids of a first turn: the full render with the generation prompt."""
        return self.encode(self.render(messages, context, generation_prompt=True))

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

    def delta_ids(
        self, messages: Sequence[Message], context: Context, previous_ended_turn: bool
    ) -> list[int]:
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

    def render_differences(
        self, token_ids: Sequence[int], messages: Sequence[Message], context: Context
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
