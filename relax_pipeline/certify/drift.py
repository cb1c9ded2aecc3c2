"""The drift classifier: a history an agent re-sent, re-rendered, against the tokens the forest holds.

For one turn, `classify` takes what the agent sent (canonical messages), what the forest committed for the
lineage it continues (the committed messages and their token ids: the model's own generated ids included) and
the model's `ChatTemplate`. It renders the sent messages with the template, compares the render's ids with the
held ids token by token over the held length (the render may go on: it holds the turn's new messages), and,
at the first differing token, names one cause, with the decoded text on both sides of that token:

- message causes, when the sent messages differ from the committed ones (`message_cause`): reasoning dropped
  or rewritten, tool-call arguments re-serialized (equal as JSON) or malformed (not JSON), a tool call
  flattened into text, the system prompt changed, content parts reordered or merged, the model's own reply
  edited (its text re-cased, re-spaced, appended to, prepended to or rewritten: `reply_edit` names which),
  whitespace (in other messages), truncation (text or messages cut), unknown;
- text causes, when the messages are equal and the template renders them differently from the ids the model
  generated (`text_cause`): the template drops or rewrites reasoning, re-serializes tool-call JSON, changes
  whitespace, closes a turn the length limit cut (truncation), or gives the same text other token ids
  (`tokenization`); anything else is unknown.

It is pure: no forest, no session, no I/O. Whether a drift forked the session and what that costs is the
caller's question (`certify/examine.py`). Mixed causes in one turn are named by the first difference only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.chat.template import ChatTemplate

REASONING_DROPPED = "reasoning_dropped"
REASONING_REWRITTEN = "reasoning_rewritten"
TOOL_ARGUMENTS_RESERIALIZED = "tool_arguments_reserialized"
TOOL_ARGUMENTS_MALFORMED = "tool_arguments_malformed"
TOOL_CALL_FLATTENED = "tool_call_flattened"
SYSTEM_PROMPT_CHANGED = "system_prompt_changed"
CONTENT_PARTS = "content_parts_reordered_or_merged"
EDITED_REPLY = "edited_reply"
WHITESPACE = "whitespace"
TRUNCATION = "truncation"
TOKENIZATION = "tokenization"
UNKNOWN = "unknown"
CAUSES: tuple[str, ...] = (REASONING_DROPPED, REASONING_REWRITTEN, TOOL_ARGUMENTS_RESERIALIZED,
                           TOOL_ARGUMENTS_MALFORMED, TOOL_CALL_FLATTENED, SYSTEM_PROMPT_CHANGED, CONTENT_PARTS,
                           EDITED_REPLY, WHITESPACE, TRUNCATION, TOKENIZATION, UNKNOWN)
"""Every cause a drift can have, in the order the certificate lists them."""
CONTEXT_CHARS = 40
"""Decoded characters shown on each side of the first differing token."""
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_TOOL_BODY = re.compile(r"(<tool_call>)(.*?)(</tool_call>)", re.DOTALL)


@dataclass(frozen=True)
class Drift:
    """Where a re-rendered history first leaves the held tokens, and why; connects `classify` to the
    certificate's template stage."""

    cause: str
    """One of `CAUSES`."""
    token_index: int
    """Position of the first differing token in the held ids; -1 when the messages differ and render the same."""
    message_index: int
    """Index of the first sent message that differs from the committed one; -1 when the messages are equal."""
    held: str
    """The held tokens decoded around the difference (`CONTEXT_CHARS` each side)."""
    rendered: str
    """The re-rendered tokens decoded around the difference."""
    held_token: str | None = None
    """The first differing held token, decoded (None: the held ids ended first)."""
    rendered_token: str | None = None
    """The first differing re-rendered token, decoded (None: the render ended first)."""
    edit: str | None = None
    """For `edited_reply`, how the agent changed the model's reply (`reply_edit`); None for other causes."""

    def as_dict(self) -> dict[str, object]:
        return {"cause": self.cause, "token_index": self.token_index, "message_index": self.message_index,
                "held": self.held, "rendered": self.rendered, "held_token": self.held_token,
                "rendered_token": self.rendered_token, "edit": self.edit}


def classify(template: ChatTemplate, sent: Sequence[Message], held: Sequence[Message], held_ids: Sequence[int],
             context: Context, held_cut: bool = False) -> Drift | None:
    """The drift of `sent` (rendered with the generation prompt) against `held_ids`; None when the held ids
    are a prefix of the render. `held`: the committed messages `held_ids` encode; `held_cut`: the last held
    turn was cut by the length limit (it ends without the end-of-turn token)."""
    rendered = template.prompt_ids(sent, context)
    index = first_difference(held_ids, rendered)
    message_index, cause = history_cause(sent, held)
    if index is None:
        return None if cause is None else _same_tokens(cause, message_index, sent, held)
    if cause is None:
        held_text, sent_text = template.decode(held_ids), template.decode(rendered[: len(held_ids) + 64])
        cause = text_cause(held_text, sent_text, held_cut)
    found = _drift(template, cause, index, message_index, held_ids, rendered)
    if cause == EDITED_REPLY:
        return replace(found, edit=reply_edit(sent[message_index].content, held[message_index].content))
    return found


def first_difference(held_ids: Sequence[int], rendered: Sequence[int]) -> int | None:
    """The first position where the render leaves the held ids; None when they are a prefix of it."""
    for i, (a, b) in enumerate(zip(held_ids, rendered, strict=False)):
        if a != b:
            return i
    return None if len(rendered) >= len(held_ids) else len(rendered)


def _drift(template: ChatTemplate, cause: str, index: int, message_index: int, held_ids: Sequence[int],
           rendered: Sequence[int]) -> Drift:
    held_text, held_at = _around(template, held_ids, index)
    rendered_text, rendered_at = _around(template, rendered, index)
    return Drift(cause, index, message_index, held_text, rendered_text, held_at, rendered_at)


def _same_tokens(cause: str, index: int, sent: Sequence[Message], held: Sequence[Message]) -> Drift:
    """Messages that differ and render to the same tokens (a flattened call written as the template writes it):
    no token differs, but the forest's hashes do, so the session forks."""
    held_text = held[index].content[:CONTEXT_CHARS] if index < len(held) else ""
    sent_text = sent[index].content[:CONTEXT_CHARS] if index < len(sent) else ""
    return Drift(cause, -1, index, held_text, sent_text)


def _around(template: ChatTemplate, ids: Sequence[int], index: int) -> tuple[str, str | None]:
    """Decoded text around position `index` (the token itself bracketed as ⟦…⟧), and that token."""
    before = template.decode(ids[:index])[-CONTEXT_CHARS:]
    if index >= len(ids):
        return before + "⟦⟧", None
    token = template.decode(ids[index : index + 1])
    after = template.decode(ids[index + 1 :])[:CONTEXT_CHARS]
    return f"{before}⟦{token}⟧{after}", token


# --- message causes -----------------------------------------------------------------------------


def history_cause(sent: Sequence[Message], held: Sequence[Message]) -> tuple[int, str | None]:
    """The first committed message the sent history changes and why; (-1, None) when it re-sends them all."""
    for i, committed in enumerate(held):
        if i >= len(sent):
            return i, TRUNCATION
        if sent[i].key() != committed.key():
            return i, _merged(sent, held, i) or message_cause(sent[i], committed) or _dropped(sent, held, i)
    return -1, None


def message_cause(sent: Message, held: Message) -> str | None:
    """Why `sent` differs from the committed `held` message (None when they are the same)."""
    if sent.key() == held.key():
        return None
    if SYSTEM_PROMPT_CHANGED in (_role_cause(sent), _role_cause(held)):
        return SYSTEM_PROMPT_CHANGED
    if sent.role != held.role:
        return None
    if sent.visible_key() == held.visible_key():
        return REASONING_DROPPED if not sent.reasoning_content else REASONING_REWRITTEN
    if held.tool_calls and not sent.tool_calls:
        return TOOL_CALL_FLATTENED
    calls = _calls_cause(sent, held)
    if calls:
        return calls
    if sent.role == "assistant" and sent.content != held.content and reply_edit(sent.content, held.content):
        return EDITED_REPLY
    return _text_cause(sent.content, held.content) or _images_cause(sent, held) or UNKNOWN


def _role_cause(message: Message) -> str | None:
    return SYSTEM_PROMPT_CHANGED if message.role == "system" else None


def _calls_cause(sent: Message, held: Message) -> str | None:
    if [c.name for c in sent.tool_calls] != [c.name for c in held.tool_calls]:
        return None
    pairs = [(a.arguments, b.arguments) for a, b in zip(sent.tool_calls, held.tool_calls, strict=True)
             if a.arguments != b.arguments]
    if not pairs:
        return None
    if any(_json(a) is None for a, _ in pairs):
        return TOOL_ARGUMENTS_MALFORMED
    if all(_json(a) == _json(b) for a, b in pairs):
        return TOOL_ARGUMENTS_RESERIALIZED
    return None


def _text_cause(sent: str, held: str) -> str | None:
    if sent == held:
        return None
    if _squeezed(sent) == _squeezed(held):
        return WHITESPACE
    if sorted(_pieces(sent)) == sorted(_pieces(held)):
        return CONTENT_PARTS
    if held.startswith(sent) or sent.startswith(held):
        return TRUNCATION
    return None


def reply_edit(sent: str, held: str) -> str | None:
    """How an agent changed the text of a reply the model generated (`held`) before re-sending it: re-cased,
    re-spaced, re-cased and re-spaced, appended to, prepended to, or rewritten; None when it only cut the text
    (truncation) or left it as it was."""
    if sent == held or held.startswith(sent):
        return None
    if sent.lower() == held.lower():
        return "re-cased"
    if _squeezed(sent) == _squeezed(held):
        return "re-spaced"
    if _squeezed(sent).lower() == _squeezed(held).lower():
        return "re-cased and re-spaced"
    if sent.startswith(held):
        return "appended to"
    return "prepended to" if sent.endswith(held) else "rewritten"


def _images_cause(sent: Message, held: Message) -> str | None:
    same = sorted(i.digest for i in sent.images) == sorted(i.digest for i in held.images)
    return CONTENT_PARTS if same and sent.images != held.images else None


def _merged(sent: Sequence[Message], held: Sequence[Message], i: int) -> str | None:
    """Two committed messages of one role re-sent as one (their texts joined, maybe with whitespace)."""
    if i + 1 >= len(held) or not (sent[i].role == held[i].role == held[i + 1].role):
        return None
    joined = _squeezed(held[i].content + held[i + 1].content)
    return CONTENT_PARTS if _squeezed(sent[i].content) == joined else None


def _dropped(sent: Sequence[Message], held: Sequence[Message], i: int) -> str:
    """Committed messages left out of the re-sent history (the rest re-sent as committed): truncation."""
    rest = [m.key() for m in sent[i:]]
    for skip in range(1, len(held) - i + 1):
        tail = [m.key() for m in held[i + skip :]]
        if tail and rest[: len(tail)] == tail:
            return TRUNCATION
    return UNKNOWN


# --- text causes --------------------------------------------------------------------------------


def text_cause(held: str, rendered: str, held_cut: bool = False) -> str:
    """Why the render of equal messages differs from the held text (both decoded from the first token)."""
    if rendered.startswith(held):
        return TOKENIZATION
    for cause, normal in ((REASONING_DROPPED, _no_reasoning), (TOOL_ARGUMENTS_RESERIALIZED, _tool_json),
                          (WHITESPACE, _squeezed)):
        if _agree(normal(held), normal(rendered)):
            if cause == REASONING_DROPPED and len(_THINK.findall(rendered)) >= len(_THINK.findall(held)):
                return REASONING_REWRITTEN
            return cause
    return TRUNCATION if held_cut else UNKNOWN


def _agree(held: str, rendered: str) -> bool:
    """Whether the normalized held text is the normalized render or a prefix of it (the render goes on)."""
    return rendered.startswith(held)


def _no_reasoning(text: str) -> str:
    return _THINK.sub("", text)


def _tool_json(text: str) -> str:
    return _TOOL_BODY.sub(lambda m: m.group(1) + _canonical_body(m.group(2)) + m.group(3), text)


def _canonical_body(body: str) -> str:
    value = _json(body)
    return body if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _squeezed(text: str) -> str:
    return "".join(text.split())


def _pieces(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def _json(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None
