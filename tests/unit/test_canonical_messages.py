"""Canonical messages (`canonical/form.py`): the shortcut for plain system, user and tool messages builds the same
`Message` and raises the same errors as the general path; the session memo's reuse gives what a fresh parse gives."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from relax_pipeline.canonical import form
from relax_pipeline.canonical.form import (
    CanonicalError,
    Context,
    arguments_value,
    chain_all,
    make_message,
    parse_message,
)
from relax_pipeline.canonical.memo import RequestMemo


def _general(raw: dict[str, Any], param: str) -> Any:
    """What `parse_message` built before its shortcut: `content_of`, then `make_message`."""
    role = "system" if raw.get("role") == "developer" else raw.get("role")
    content, images = form.content_of(raw.get("content"), f"{param}.content")
    call_id = raw.get("tool_call_id")
    return make_message(role, content, param, raw.get("reasoning_content"), (),
                        call_id if isinstance(call_id, str) else None, images)


SHAPES = [dict(zip(("role", "content", "extra"), values, strict=True)) for values in itertools.product(
    ["system", "user", "tool", "developer", "robot", None], ["text", "", None, 7, [{"type": "text", "text": "t"}]],
    [{}, {"name": "n"}, {"tool_call_id": "c1"}, {"tool_call_id": 3}, {"name": "n", "tool_call_id": "c2"}])]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['role']}-{s['content']!r}-{sorted(s['extra'])}")
def test_plain_messages_parse_as_the_general_path(shape: dict[str, Any]) -> None:
    raw = {k: v for k, v in (("role", shape["role"]), ("content", shape["content"])) if v is not None}
    raw |= shape["extra"]
    try:
        expected: Any = _general(raw, "messages[3]")
    except CanonicalError as error:
        expected = (error.message, error.param)
    try:
        got: Any = parse_message(raw, "messages[3]")
    except CanonicalError as error:
        got = (error.message, error.param)
    assert got == expected
    if not isinstance(got, tuple):
        assert got.tool_call_id == expected.tool_call_id


def test_the_memo_gives_what_a_fresh_parse_gives() -> None:
    memo, context = RequestMemo(), Context()
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u0"}]
    for turn in range(6):
        messages, hashes = memo.canonical(list(history), context, parse_message)
        fresh = tuple(parse_message(m, "m") for m in history)
        assert messages == fresh and list(hashes) == chain_all(context, fresh)
        history += [{"role": "assistant", "content": f"a{turn}"}, {"role": "tool", "tool_call_id": f"c{turn}",
                                                                     "content": f"r{turn}"}]
    retried = history[:3] + [{"role": "user", "content": "changed"}]
    messages, hashes = memo.canonical(retried, context, parse_message)
    assert messages == tuple(parse_message(m, "m") for m in retried)
    assert list(hashes) == chain_all(context, messages)


def test_arguments_read_as_the_standard_library_reads_them() -> None:
    import json

    texts = ['{"city":"Oslo","year":2000}', '{"x":NaN,"y":-Infinity}', '{"n":123456789012345678901234567890}',
             '{"s":"\\ud800"}', '{"f":1e-7,"g":-0.0,"h":[1.5,2]}', '{"a":1,"a":2}', "not json", "", "[1,2", '"text"',
             "id 12345678901234567890 x"]
    for text in texts:
        try:
            expected = json.loads(text)
        except ValueError:
            expected = text
        got = arguments_value(text)
        assert json.dumps(got) == json.dumps(expected) and type(got) is type(expected), text


def test_tool_call_arguments_canonicalize_as_the_standard_library_does() -> None:
    """orjson's shortcut (`_canonical_json_text`) writes what `json` writes, and leaves it everything else."""
    import json
    import random

    from relax_pipeline.canonical.form import _canonical_json_text

    rng = random.Random(0)
    atoms = ['"a"', '"\\u00e9"', '"\\ud83d\\ude00"', '"\\uffff"', '"\\u0000\\n\\t"', "1", "-0", "18446744073709551615",
             "1" * 25, "1.5", "1e5", "2E-3", "NaN", "true", "null", '"\\ud800"', '"\x7f\u2028"', "[]", "{}"]

    def value(depth: int) -> str:
        if depth > 2 or rng.random() < 0.4:
            return rng.choice(atoms)
        if rng.random() < 0.5:
            return "[" + ",".join(value(depth + 1) for _ in range(rng.randint(0, 3))) + "]"
        keys = [rng.choice(['"b"', '"a"', '"é"', '"\\uffff"', '"😀"', '"a"']) for _ in range(rng.randint(0, 4))]
        return "{" + ", ".join(f"{k}: {value(depth + 1)}" for k in keys) + "}"

    texts = [value(0) for _ in range(3000)] + ["[" * 2000 + "]" * 2000, "not json", "{'a': 1}", " {\"a\" : 1} "]
    for text in texts:
        try:
            expected = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except ValueError:
            expected = text
        except RecursionError:
            continue
        assert _canonical_json_text.__wrapped__(text) == expected, text
