"""Delta shapes: a delta filled into a cached skeleton is exactly the template's own render, or is rendered.

Every case compares `ChatTemplate.delta_text` (which takes the skeleton when it can) with a real Jinja
render of the same messages, under the tiny template and under templates that look at contents (`trim`,
a substring test, a tool-response wrapper test); the counters show which path each case took.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.chat.template import ChatTemplate, DeltaShapes
from relax_pipeline.models.tiny import QWEN3_DROP_REASONING_TEMPLATE

TOOLS = ({"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},)
TRIMMING = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
LOOKING = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if 'DONE' in m.content %}[done]{%- endif %}"
           "{{ m.content }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WRAPPED = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.content.startswith('<obs>') %}OBS{%- endif %}"
           "{{ m.content }}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
DELTAS = [
    (Message("tool", "Record 3: 1200 residents.", tool_call_id="call_0"),),
    (Message("user", "Go on with the next part."),),
    (Message("tool", "a", tool_call_id="c1"), Message("tool", "  b  ", tool_call_id="c2"), Message("user", "next")),
    (Message("tool", "<tool_response>\nnested\n</tool_response>", tool_call_id="x"),),
    (Message("user", "DONE with step 1"),),
    (Message("user", "<obs>seen</obs>"),),
    (Message("tool", "", tool_call_id="e"),),
    (Message("system", "Be brief."), Message("user", "ünï {{ x }}")),
]


class Counting(DeltaShapes):
    """DeltaShapes that counts skeleton fills and declined deltas."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.filled = self.declined = 0

    def render(self, messages: Any, context: Context, tools: bool) -> str | None:
        text = super().render(messages, context, tools)
        self.filled += text is not None
        self.declined += text is None
        return text


def with_template(tokenizer: Any, source: str | None) -> ChatTemplate:
    if source is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = source
    template = ChatTemplate(tokenizer, end_of_turn="<|im_end|>")
    template._shapes = Counting(template._tail, tokenizer)
    return template


def rendered(template: ChatTemplate, delta: tuple[Message, ...], context: Context) -> str:
    tail = template._tail([m.to_template() for m in delta], context, template._need_tools(context))
    return tail[len(template.end_of_turn):]


@pytest.mark.parametrize("source", [None, QWEN3_DROP_REASONING_TEMPLATE, TRIMMING, LOOKING, WRAPPED])
@pytest.mark.parametrize("context", [Context(), Context(TOOLS)])
def test_filled_delta_equals_a_render(tokenizer: Any, source: str | None, context: Context) -> None:
    template = with_template(tokenizer, source)
    for _ in range(2):  # the second pass fills the skeletons the first one built
        for delta in DELTAS:
            assert template.delta_text(delta, context, True) == rendered(template, delta, context), delta


@pytest.mark.parametrize(("source", "marked"), [(LOOKING, DELTAS[4]), (WRAPPED, DELTAS[5])])
def test_values_with_a_tested_literal_are_rendered(tokenizer: Any, source: str, marked: tuple[Message, ...]) -> None:
    template = with_template(tokenizer, source)
    plain = (Message("user", "Go on with step 2."),)
    for delta in (plain, plain, marked):
        template.delta_text(delta, Context(), True)
    assert (template._shapes.filled, template._shapes.declined) == (2, 1)


def test_a_template_that_trims_contents_is_always_rendered(tokenizer: Any) -> None:
    template = with_template(tokenizer, TRIMMING)
    for delta in DELTAS[:2]:
        template.delta_text(delta, Context(), True)
    assert (template._shapes.filled, template._shapes.declined) == (0, 2)


def test_tiny_template_fills_plain_and_wrapped_tool_results(tokenizer: Any) -> None:
    template = with_template(tokenizer, None)
    for delta in (DELTAS[0], DELTAS[0], DELTAS[3]):
        template.delta_text(delta, Context(), True)
    assert (template._shapes.filled, template._shapes.declined) == (3, 0)


def test_assistant_messages_are_rendered(tokenizer: Any) -> None:
    template = with_template(tokenizer, None)
    delta = (Message("assistant", "prefill", reasoning_content="r"), Message("user", "u"))
    assert template.delta_text(delta, Context(), True) == rendered(template, delta, Context())
    assert template._shapes.declined == 1
