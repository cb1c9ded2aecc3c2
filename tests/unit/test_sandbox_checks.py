"""Sandbox shortcuts (`chat/codec.py`): a template compiled with `_Checks` renders what Jinja's immutable sandbox
renders, refuses what it refuses, and a chat template's fast path and `prompt_array` give the Hugging Face ids.
"""

from __future__ import annotations

from array import array
from collections.abc import MutableSequence
from typing import Any

import pytest
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.chat.codec import _with_checks
from relax_pipeline.chat.template import ChatTemplate

SOURCE = """{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{{ loop.index }} {{ m.role }} {{ m.content.strip() }} {{ m.missing is defined }} {{ m.items() | list | length }}
{{- m['role'] }} {{ m.get('content') }} {{ ns.n }} {{ loop.last }} {{ m.keys is defined }} {{ m.__class__ }}
{%- set ns.n = ns.n + 1 -%}
{%- endfor -%}
{{ tools.__class__ }} {{ ''.__class__ }} {{ (1).real }} {{ [1, 2].index(2) }} {{ '{}-{}'.format(1, 'b') }}"""
MESSAGES = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "a", "items": "shadowed"},
            {"keys": 1, "content": "", "role": "tool"}]


def _pair(source: str) -> tuple[Any, Any]:
    env = ImmutableSandboxedEnvironment()
    plain = env.from_string(source)
    shortcut, checks = _with_checks(plain, source)
    assert checks is not None
    return plain, shortcut


def test_shortcut_template_renders_what_the_sandbox_renders() -> None:
    plain, shortcut = _pair(SOURCE)
    for messages in (MESSAGES, MESSAGES[:1], []):
        assert shortcut.render(messages=messages, tools=None) == plain.render(messages=messages, tools=None)


@pytest.mark.parametrize("source", ["{{ messages.append(1) }}", "{{ messages[0].update({}) }}",
                                    "{{ messages[0].pop('role') }}", "{{ ''.__class__.__mro__ }}",
                                    "{{ messages.__class__.__subclasses__() }}"])
def test_shortcut_template_refuses_what_the_sandbox_refuses(source: str) -> None:
    plain, shortcut = _pair(source)
    outcomes = []
    for template in (plain, shortcut):
        try:
            outcomes.append(("ok", template.render(messages=[{"role": "user"}])))
        except (SecurityError, UndefinedError) as error:
            outcomes.append((type(error).__name__, str(error)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] != "ok" or "append" not in source


def test_decisions_are_dropped_when_an_abc_registers_a_class() -> None:
    plain, shortcut = _pair("{{ value.count('a') }}")

    class Text(str):
        pass

    assert shortcut.render(value="aa") == plain.render(value="aa") == "2"
    MutableSequence.register(Text)  # the sandbox now treats `Text` as mutable; `str` itself is unchanged
    assert shortcut.render(value=Text("aa")) == plain.render(value=Text("aa"))


def test_prompt_array_is_the_prompt_ids(template: ChatTemplate) -> None:
    messages = (Message("system", "Be brief."), Message("user", "What is 2 + 2?"))
    ids = template.prompt_array(messages, Context())
    assert isinstance(ids, array)
    text = template.tokenizer.apply_chat_template([m.to_template() for m in messages], add_generation_prompt=True,
                                                  tokenize=False)
    expected = template.tokenizer.encode(text, add_special_tokens=False)
    assert ids.tolist() == template.prompt_ids(messages, Context()) == list(expected)
    again = template.prompt_array(messages, Context())
    again.append(0)  # a fresh array each time: changing it leaves the kept ids alone
    assert template.prompt_ids(messages, Context()) == list(expected)


def test_namespaces_are_decided_by_type_unless_they_could_lie_about_their_class() -> None:
    from jinja2.utils import Namespace

    from relax_pipeline.chat.codec import _Checks

    class Plain(Namespace):
        pass

    class Lying(Namespace):
        __class__ = list  # type: ignore[assignment]

    checks = _Checks(ImmutableSandboxedEnvironment())
    assert checks._learn(Namespace) and checks._learn(Plain)
    assert not checks._learn(Lying) and not checks._learn(dict)


def test_the_tiny_models_template_runs_with_the_shortcuts(template: ChatTemplate) -> None:
    renderer = template._renderer
    assert renderer._checks is not None, "the compiled template fell back to the plain sandbox (or the slow path)"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert renderer(messages, None, True, {}) == renderer._slow(messages, None, True, {})


def test_delta_array_is_delta_ids(template: ChatTemplate) -> None:
    for delta in [(Message("tool", "42", tool_call_id="c1"),), (Message("user", "ünï then {{ x }}"),),
                  (Message("tool", "a"), Message("user", "b"))]:
        for ended in (True, False):
            ids = template.delta_array(delta, Context(), ended)
            assert isinstance(ids, array) and ids.tolist() == template.delta_ids(delta, Context(), ended)
