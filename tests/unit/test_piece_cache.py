"""Kept ids (`chat/codec.py`): ids of a text from its pieces between added tokens equal the tokenizer's
whole-text ids, kept pieces are reused across texts, tokenizers where cutting is not exact get none, and a first
prompt is rendered once for a group's identical first requests but again for anything the template reads.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from tokenizers import AddedToken

from relax_pipeline.canonical.form import Context, Message, ToolCall
from relax_pipeline.chat.template import ChatTemplate, Codec, Pieces

TOOL = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


def _random_texts(tokenizer: Any, count: int) -> list[str]:
    rng = random.Random(0)
    alphabet = [*"ab \n\t.ü{}\"<>|_", "hello", " world", "  ", *tokenizer.get_added_vocab()]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(count)]


def test_pieces_equal_whole_text_ids(template: ChatTemplate) -> None:
    codec = template.codec
    assert codec.pieces is not None
    for text in _random_texts(template.tokenizer, 2000):
        assert codec.encode(text, keep=True) == codec._encode(text), repr(text)
        assert codec.encode(text) == codec._encode(text), repr(text)


def test_first_prompt_keeps_its_pieces_for_the_next_session(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    pieces = template.codec.pieces
    assert pieces is not None
    system = Message("system", "You are a careful agent. " * 40)
    first = template.prompt_ids((system, Message("user", "Session 1: go.")), Context())
    calls: list[str] = []
    encode = pieces._piece_ids
    pieces._piece_ids = lambda text: calls.append(text) or encode(text)  # type: ignore[method-assign]
    second = template.prompt_ids((system, Message("user", "Session 2: go.")), Context())
    assert second == template.codec._encode(template.render((system, Message("user", "Session 2: go.")),
                                                            Context(), True))
    assert first == template.codec._encode(template.render((system, Message("user", "Session 1: go.")), Context(),
                                                            True))
    assert calls == ["user\nSession 2: go."]  # the system piece and the template's glue were known


def test_budget_drops_least_recently_used(tokenizer: Any) -> None:
    codec = Codec(tokenizer)
    assert codec.pieces is not None
    codec.pieces.kept.budget = 10
    codec.encode("aaaaaa<|im_end|>bbbbbb", keep=True)
    assert list(codec.pieces.kept._kept) == ["bbbbbb"]
    assert codec.encode("aaaaaa<|im_end|>bbbbbb") == codec._encode("aaaaaa<|im_end|>bbbbbb")


def test_no_pieces_where_an_added_token_strips_spaces(tokenizer: Any) -> None:
    stripping = copy.deepcopy(tokenizer)
    stripping.add_tokens([AddedToken("<obs>", lstrip=True, rstrip=True)])
    assert Pieces.of(stripping, Codec(stripping)._encode) is None
    assert Codec(stripping).encode("x <obs> y") == stripping.encode("x <obs> y", add_special_tokens=False)


def test_a_groups_same_first_request_renders_once(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    renders: list[int] = []
    render = template._render
    template._render = lambda *a, **k: renders.append(1) or render(*a, **k)  # type: ignore[method-assign]
    tools = (TOOL,)
    history = [Message("user", "go"), Message("assistant", "", tool_calls=(ToolCall("calc", "{}", "call_1"),)),
               Message("tool", "4", tool_call_id="call_1")]
    first = template.prompt_ids(tuple(history), Context(tools))
    again = template.prompt_ids(tuple(history), Context(tools))
    assert again == first and len(renders) == 1
    other_id = [history[0], Message("assistant", "", tool_calls=(ToolCall("calc", "{}", "call_2"),)),
                Message("tool", "4", tool_call_id="call_2")]
    assert template.prompt_ids(tuple(other_id), Context(tools)) == template.codec._encode(
        render([m.to_template() for m in other_id], Context(tools), True))
    assert len(renders) == 2  # a tool-call id is not in a message's hash, but the template may read it
