"""examples/arith's calculator environment (`agent=arith_calc`) on hand-written transcripts: correct use,
malformed use, no use, too many turns, and the single-shot control; and the agent's opening messages."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from relax_pipeline.config import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "arith"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


calc = load("calc")


def scripted(*replies: str) -> tuple[list[list[dict]], object]:
    """An `ask` that answers with `replies` in order and records the messages it saw."""
    seen: list[list[dict]] = []
    it: Iterator[str] = iter(replies)

    def ask(messages: list[dict]) -> str:
        seen.append([dict(m) for m in messages])
        return next(it)

    return seen, ask


def test_correct_use_gets_the_value_and_the_answer_is_checked() -> None:
    seen, ask = scripted("calc 47 * 86", "calc 4042 + 12", "The answer is 4054.")
    messages = [{"role": "user", "content": "What is 47 * 86 + 12?"}]
    outcome = calc.episode(ask, messages, 4054, max_turns=4)
    assert (outcome.reward, outcome.turns, outcome.calls, outcome.malformed) == (1.0, 3, 2, 0)
    assert [m["content"] for m in messages[1:]] == ["calc 47 * 86", "calculator: 4042", "calc 4042 + 12",
                                                   "calculator: 4054", "The answer is 4054."]
    assert seen[1][-1] == {"role": "user", "content": "calculator: 4042"}  # the next turn sees the tool's reply
    assert outcome.metadata(True) == {"used_tool": 1.0, "turns": 3.0, "calls": 2.0, "malformed": 0.0,
                                      "too_many_turns": 0.0, "tools": 1.0}


def test_a_wrong_final_answer_scores_zero_even_after_good_calls() -> None:
    _, ask = scripted("calc 47 * 86", "The answer is 4042.")
    outcome = calc.episode(ask, [], 4054, max_turns=4)
    assert (outcome.reward, outcome.calls, outcome.turns) == (0.0, 1, 2)


@pytest.mark.parametrize("call", ["calc 12 * 34 + 5", "calc twelve times 34", "calc", "calc 12 / 4"])
def test_malformed_use_gets_an_error_naming_the_form(call: str) -> None:
    _, ask = scripted(call, "calc 12 * 34", "408")
    messages: list[dict] = []
    outcome = calc.episode(ask, messages, 408, max_turns=4)
    assert messages[1]["content"] == calc.MALFORMED and "calc 12 * 34" in calc.MALFORMED
    assert (outcome.reward, outcome.calls, outcome.malformed, outcome.turns) == (1.0, 1, 1, 3)


def test_no_use_is_a_final_answer_on_the_first_turn() -> None:
    _, ask = scripted("47 * 86 = 4042, so the answer is 4054")
    outcome = calc.episode(ask, [], 4054, max_turns=4)
    assert (outcome.reward, outcome.turns, outcome.calls) == (1.0, 1, 0)
    assert outcome.metadata(True)["used_tool"] == 0.0


def test_too_many_turns_ends_with_reward_zero() -> None:
    _, ask = scripted(*["calc 1 + 1"] * 4)
    outcome = calc.episode(ask, [], 2, max_turns=4)
    assert (outcome.reward, outcome.turns, outcome.calls, outcome.too_many_turns) == (0.0, 4, 4, True)


def test_the_control_withholds_the_tool_and_makes_one_call() -> None:
    _, ask = scripted("calc 47 * 86", "4054")
    outcome = calc.episode(ask, [], 4042, max_turns=4, tools=False)
    assert (outcome.reward, outcome.turns, outcome.calls) == (0.0, 1, 0)  # "calc ..." is its (wrong) answer


@pytest.mark.parametrize("text, value", [("calc 12 * 34", 408), ("calc: 3 - 10", -7), ("CALC 5 x 6 =", 30),
                                         ("calc 2 × 3.", 6), ("calc 1 + 2\nthen more", 3)])
def test_the_parser_reads_the_first_line(text: str, value: int) -> None:
    expression = calc.tool_call(text)
    assert expression is not None and calc.calculate(expression) == value


@pytest.mark.parametrize("text", ["The answer is 408.", "I will calc 12 * 34", "", "calculate 12 * 34"])
def test_other_replies_are_final(text: str) -> None:
    assert calc.tool_call(text) is None


def test_final_answer_is_the_last_integer() -> None:
    assert calc.final_answer("12 * 34 = 408, plus 56 is 1,464") == 1464 and calc.final_answer("none") is None


def test_the_agent_opens_with_the_example_or_the_control(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    agent = load("calc_agent")
    assert agent.opening("What is 3 * 4?", tools=True) == [
        {"role": "user", "content": f"What is 3 * 4? {calc.INSTRUCTION}"}]
    with_example = agent.opening("What is 3 * 4?", tools=True, example="add")
    assert [m["role"] for m in with_example] == ["user", "assistant", "user", "assistant", "user"]
    assert with_example[1] == {"role": "assistant", "content": "calc 12 + 34"}
    format_only = agent.opening("What is 3 * 4?", tools=True, example="call")
    assert [m["role"] for m in format_only] == ["user", "assistant", "user"] and format_only[:2] == with_example[:2]
    assert agent.opening("What is 3 * 4?", tools=False) == [
        {"role": "user", "content": f"What is 3 * 4? {calc.CONTROL}"}]
