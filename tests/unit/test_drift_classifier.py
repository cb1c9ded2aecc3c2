"""The drift classifier (`certify/drift.py`): each cause, produced by a constructed pair of histories (what the
forest holds, what an agent re-sent), is classified as that cause and nothing else, with the first differing
token decoded; a verbatim replay is no drift. Histories are rendered with the tiny model's template."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest

from relax_pipeline.canonical.form import Context, Message, ToolCall
from relax_pipeline.certify import drift
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.models.tiny import QWEN3_DROP_REASONING_TEMPLATE

TOOLS = ({"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}},)
CTX = Context(TOOLS)
SYSTEM = Message("system", "You are a careful assistant.")
USER = Message("user", "Read the file and say what it holds.")
CALL = Message("assistant", "", "I should read it first.", (ToolCall("read", '{"line":3,"path":"a.py"}', "c0"),))
RESULT = Message("tool", "print('hi')\nprint('bye')", tool_call_id="c0")
ANSWER = Message("assistant", "It prints hi then bye.", "Two prints.")
NEXT = Message("user", "Thanks. And the next file?")
HELD = (SYSTEM, USER, CALL, RESULT, ANSWER)


def held_ids(template: ChatTemplate, held: Sequence[Message], context: Context = CTX) -> list[int]:
    """What the forest holds for `held`: its render up to the last assistant's end-of-turn token."""
    text = template.render(held, context, generation_prompt=False)
    return template.encode(text[: text.rindex(template.end_of_turn) + len(template.end_of_turn)])


def classified(template: ChatTemplate, sent: Sequence[Message], held: Sequence[Message] = HELD,
               ids: Sequence[int] | None = None, **kwargs: Any) -> drift.Drift | None:
    held_tokens = held_ids(template, held) if ids is None else ids
    return drift.classify(template, (*sent, NEXT), held, held_tokens, CTX, **kwargs)


def replaced(index: int, message: Message) -> tuple[Message, ...]:
    return tuple(message if i == index else m for i, m in enumerate(HELD))


def test_a_verbatim_replay_is_no_drift(template: ChatTemplate) -> None:
    assert classified(template, HELD) is None


@pytest.mark.parametrize("sent, cause", [
    (replaced(2, Message("assistant", "", None, CALL.tool_calls)), drift.REASONING_DROPPED),
    (replaced(4, Message("assistant", ANSWER.content, None)), drift.REASONING_DROPPED),
    (replaced(2, Message("assistant", "", "I will read it.", CALL.tool_calls)), drift.REASONING_REWRITTEN),
    (replaced(2, Message("assistant", "", CALL.reasoning_content, (ToolCall("read", '{"path": "a.py", "line": 3}'),))),
     drift.TOOL_ARGUMENTS_RESERIALIZED),
    (replaced(2, Message("assistant", "", CALL.reasoning_content, (ToolCall("read", "{'path': 'a.py', 'line': 3}"),))),
     drift.TOOL_ARGUMENTS_MALFORMED),
    (replaced(2, Message("assistant", 'read({"line": 3, "path": "a.py"})', CALL.reasoning_content)),
     drift.TOOL_CALL_FLATTENED),
    (replaced(0, Message("system", "You are a careful assistant. Today is Friday.")), drift.SYSTEM_PROMPT_CHANGED),
    (replaced(3, Message("tool", "print('bye')\nprint('hi')", tool_call_id="c0")), drift.CONTENT_PARTS),
    (replaced(1, Message("user", "Read the file  and say what it holds.\n")), drift.WHITESPACE),
    (replaced(3, Message("tool", "print('hi')", tool_call_id="c0")), drift.TRUNCATION),
    ((SYSTEM, CALL, RESULT, ANSWER), drift.TRUNCATION),
    (replaced(1, Message("user", "Something else entirely.")), drift.UNKNOWN),
    (replaced(4, Message("assistant", "it prints hi then bye.", ANSWER.reasoning_content)), drift.EDITED_REPLY),
    (replaced(4, Message("assistant", "It prints hi then bye. (sic)", ANSWER.reasoning_content)), drift.EDITED_REPLY),
    (replaced(4, Message("assistant", "It prints hi", ANSWER.reasoning_content)), drift.TRUNCATION),
])
def test_each_message_cause_is_that_cause(template: ChatTemplate, sent: tuple[Message, ...], cause: str) -> None:
    found = classified(template, sent)
    assert found is not None and found.cause == cause, found
    assert found.message_index >= 0 and "⟦" in found.held and "⟦" in found.rendered
    assert found.held_token != found.rendered_token


@pytest.mark.parametrize("content, edit, held_token, rendered_token", [
    ("it prints hi then bye.", "re-cased", "I", "it"),  # the tiny tokenizer's cuts
    ("It prints  hi then bye.\n", "re-spaced", " hi", " "),
    ("It prints hi then bye. Anything else?", "appended to", "<|im_end|>", " A"),
])
def test_an_edited_reply_names_the_edit_and_decodes_the_first_differing_token(
        template: ChatTemplate, content: str, edit: str, held_token: str, rendered_token: str) -> None:
    """An agent that edits the model's own reply before re-sending it (re-cases, re-spaces or appends to it):
    `edited_reply`, how it was edited, and the two tokens where the render first leaves the held ids."""
    found = classified(template, replaced(4, Message("assistant", content, ANSWER.reasoning_content)))
    assert found is not None and (found.cause, found.edit, found.message_index) == (drift.EDITED_REPLY, edit, 4)
    assert (found.held_token, found.rendered_token) == (held_token, rendered_token)
    assert f"⟦{held_token}⟧" in found.held and f"⟦{rendered_token}⟧" in found.rendered
    assert found.as_dict()["edit"] == edit


@pytest.mark.parametrize("sent, edit", [
    ("IT PRINTS HI", "re-cased"), ("It  prints\thi\n", "re-spaced"), ("it  prints hi", "re-cased and re-spaced"),
    ("It prints hi!", "appended to"), ("Sure. It prints hi", "prepended to"), ("It says bye", "rewritten"),
    ("It prints", None), ("It prints hi", None),
])
def test_reply_edit_names_how_the_text_changed(sent: str, edit: str | None) -> None:
    assert drift.reply_edit(sent, "It prints hi") == edit


def test_whitespace_outside_the_models_replies_stays_whitespace(template: ChatTemplate) -> None:
    found = classified(template, replaced(3, Message("tool", "print('hi')\n  print('bye')", tool_call_id="c0")))
    assert found is not None and found.cause == drift.WHITESPACE and found.edit is None


def test_a_call_flattened_into_the_text_the_template_writes_renders_the_same_and_still_drifts(
        template: ChatTemplate) -> None:
    text = template.render((USER, CALL), CTX, False).split("</think>\n\n")[-1].split(template.end_of_turn)[0]
    found = classified(template, replaced(2, Message("assistant", text, CALL.reasoning_content)))
    assert found is not None and found.cause == drift.TOOL_CALL_FLATTENED
    assert found.token_index == -1 and found.message_index == 2 and "<tool_call>" in found.rendered


def test_two_messages_merged_into_one_are_content_parts(template: ChatTemplate) -> None:
    held = (SYSTEM, USER, Message("user", "Be brief."), ANSWER)
    sent = (SYSTEM, Message("user", USER.content + "\n" + "Be brief."), ANSWER)
    found = classified(template, sent, held)
    assert found is not None and found.cause == drift.CONTENT_PARTS and found.message_index == 1


def test_a_template_that_drops_history_reasoning_is_reasoning_dropped(tokenizer: Any, template: ChatTemplate) -> None:
    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = QWEN3_DROP_REASONING_TEMPLATE
    found = classified(ChatTemplate(dropping), HELD, ids=held_ids(template, HELD))
    assert found is not None and found.cause == drift.REASONING_DROPPED and found.message_index == -1
    assert "<think>" in (found.held_token or "") + found.held


def test_tool_json_the_model_wrote_in_its_own_order_is_reserialized(template: ChatTemplate) -> None:
    raw = Message("assistant", "", CALL.reasoning_content, (ToolCall("read", '{"path": "a.py", "line": 3}', "c0"),))
    generated = held_ids(template, (SYSTEM, USER, raw, RESULT, ANSWER))  # the model's own key order
    found = classified(template, HELD, ids=generated)
    assert found is not None and found.cause == drift.TOOL_ARGUMENTS_RESERIALIZED and found.message_index == -1


def test_the_same_text_in_other_token_ids_is_tokenization(template: ChatTemplate) -> None:
    ids = held_ids(template, HELD)
    at = len(ids) - 4
    split = [t for c in template.decode(ids[at : at + 1]) for t in template.encode(c)]
    assert len(split) > 1, "a multi-character token to split"
    found = classified(template, HELD, ids=[*ids[:at], *split, *ids[at + 1 :]])
    assert found is not None and found.cause == drift.TOKENIZATION and found.token_index == at


def test_a_reply_cut_by_the_length_limit_is_truncation(template: ChatTemplate) -> None:
    ids = held_ids(template, HELD)
    cut = ids[: len(ids) - 3] + template.encode(" and more")  # generated on past what the parser kept
    assert classified(template, HELD, ids=cut, held_cut=True).cause == drift.TRUNCATION
    assert classified(template, HELD, ids=cut).cause == drift.UNKNOWN


def test_every_cause_is_listed_once() -> None:
    assert len(set(drift.CAUSES)) == len(drift.CAUSES)
