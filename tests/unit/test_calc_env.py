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


# Chained problems (`agent=arith_chain`, `dataset.steps`): hand-written transcripts of `(47 + 86) * 12`.

def test_a_correct_chain_feeds_each_value_into_the_next_call() -> None:
    seen, ask = scripted("calc 47 + 86", "calc 133 * 12", "The answer is 1596.")
    messages = [{"role": "user", "content": "What is (47 + 86) * 12?"}]
    outcome = calc.episode(ask, messages, 1596, max_turns=5)
    assert seen[1][-1] == {"role": "user", "content": "calculator: 133"}
    assert seen[2][-1] == {"role": "user", "content": "calculator: 1596"}
    assert (outcome.reward, outcome.calls, outcome.operands, outcome.values) == (1.0, 2, [(47, 86), (133, 12)],
                                                                                 [133, 1596])
    figures = outcome.metadata(True, steps=2)
    assert {k: figures[k] for k in ("solved_2", "calls_2", "solved_multi", "chained", "linked")} == {
        "solved_2": 1.0, "calls_2": 2.0, "solved_multi": 1.0, "chained": 1.0, "linked": 1.0}
    assert "solved_1" not in figures and "solved_3" not in figures


def test_a_chain_that_reuses_a_stale_value_is_wrong_and_not_linked() -> None:
    # (47 + 86) * 12 - 5: the third call takes the first value (133) instead of the second (1596).
    _, ask = scripted("calc 47 + 86", "calc 133 * 12", "calc 133 - 5", "The answer is 128.")
    outcome = calc.episode(ask, [], 1591, max_turns=5)
    figures = outcome.metadata(True, steps=3)
    assert (outcome.reward, outcome.calls, outcome.values) == (0.0, 3, [133, 1596, 128])
    assert (figures["chained"], figures["linked"], figures["solved_3"]) == (1.0, 0.0, 0.0)


def test_a_second_call_on_the_original_numbers_is_not_chained() -> None:
    _, ask = scripted("calc 47 + 86", "calc 86 * 12", "1032")
    outcome = calc.episode(ask, [], 1596, max_turns=5)
    assert (outcome.reward, outcome.chained(), outcome.linked()) == (0.0, False, False)


def test_a_malformed_call_in_a_chain_gets_the_error_and_the_chain_goes_on() -> None:
    _, ask = scripted("calc 47 + 86", "calc 133 * 12 - 5", "calc 133 * 12", "calc 1596 - 5", "1591")
    messages: list[dict] = []
    outcome = calc.episode(ask, messages, 1591, max_turns=5)
    assert messages[3] == {"role": "user", "content": calc.MALFORMED}
    assert (outcome.reward, outcome.calls, outcome.malformed, outcome.turns, outcome.linked()) == (1.0, 3, 1, 5, True)


def test_no_call_on_a_chain_is_its_answer_and_chains_nothing() -> None:
    _, ask = scripted("The answer is 1596.")
    figures = calc.episode(ask, [], 1596, max_turns=5).metadata(True, steps=2)
    assert (figures["solved_2"], figures["calls"], figures["chained"], figures["linked"]) == (1.0, 0.0, 0.0, 0.0)


def test_a_chain_past_the_cap_ends_with_reward_zero() -> None:
    _, ask = scripted("calc 47 + 86", "calc 133 * 12", "calc 1596 - 5", "calc 1591 - 0", "calc 1591 + 0")
    outcome = calc.episode(ask, [], 1591, max_turns=5)
    figures = outcome.metadata(True, steps=3)
    assert (outcome.reward, outcome.too_many_turns, figures["solved_3"], figures["linked"]) == (0.0, True, 0.0, 1.0)


def test_the_chain_instruction_is_what_the_chain_agent_opens_with(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    agent = load("calc_agent")
    opened = agent.opening("What is (47 + 86) * 12?", tools=True, example="call",
                           instruction=calc.INSTRUCTIONS["chain"])
    assert opened[0]["content"] == f"What is 12 + 34? {calc.CHAIN_INSTRUCTION}"
    assert opened[-1]["content"] == f"What is (47 + 86) * 12? {calc.CHAIN_INSTRUCTION}"
    assert not any(ch.isdigit() for ch in calc.CHAIN_INSTRUCTION)  # no numbers for the model to copy


@pytest.mark.parametrize("call", ["calc 47 + 86 * 12", "calc (47 + 86) * 12", "calc 1 + 2 + 3 + 4 ="])
def test_a_call_of_several_operations_gets_the_one_at_a_time_error_in_the_chain_setting(call: str) -> None:
    _, ask = scripted(call, "calc 47 + 86", "calc 133 * 12", "1596")
    messages: list[dict] = []
    outcome = calc.episode(ask, messages, 1596, max_turns=5, replies=calc.Replies(one_at_a_time=True))
    assert messages[1] == {"role": "user", "content": calc.ONE_AT_A_TIME}
    assert not any(ch.isdigit() for ch in calc.ONE_AT_A_TIME)
    assert (outcome.reward, outcome.malformed, outcome.calls, outcome.linked()) == (1.0, 1, 2, True)
    assert calc.respond(call.removeprefix("calc"))[0] == calc.MALFORMED  # agent=arith_calc's reply is unchanged


def test_a_call_that_is_not_arithmetic_gets_the_general_error_in_the_chain_setting() -> None:
    for replies in (calc.Replies(one_at_a_time=True), calc.Replies(name_first=True)):
        assert calc.respond(" twelve times 34", replies) == (calc.MALFORMED, False)
        assert calc.respond(" 12 / 4 + 3", replies) == (calc.MALFORMED, False)


@pytest.mark.parametrize("call, first", [(" 47 * 86 + 12", "47 * 86"), (" (47 + 86) x 12 =", "47 + 86"),
                                         (" -3 - 4 * 5", "-3 - 4")])
def test_name_first_names_the_first_operation_of_the_models_own_call(call: str, first: str) -> None:
    assert calc.respond(call, calc.Replies(name_first=True)) == (calc.FIRST_OPERATION.format(first=first), False)


def test_echo_returns_the_value_with_its_call() -> None:
    _, ask = scripted("calc 47 x 86", "calc 4042 + 12", "4054")
    messages: list[dict] = []
    outcome = calc.episode(ask, messages, 4054, max_turns=5, replies=calc.Replies(echo=True))
    assert [messages[1]["content"], messages[3]["content"]] == ["calculator: 47 * 86 = 4042",
                                                                "calculator: 4042 + 12 = 4054"]
    assert (outcome.reward, outcome.values, outcome.linked()) == (1.0, [4042, 4054], True)


def test_made_calls_are_the_environments_own_first_calls_of_a_chain() -> None:
    made = calc.made_calls([47, 86, 12, 5], ["+", "*", "-"], 2)
    assert made == [{"role": "assistant", "content": "calc 47 + 86"}, {"role": "user", "content": "calculator: 133"},
                    {"role": "assistant", "content": "calc 133 * 12"},
                    {"role": "user", "content": "calculator: 1596"}]
    assert calc.made_calls([47, 86], ["+"], 0) == []
    _, ask = scripted("calc 1596 - 5", "1591")  # the model makes the call that is left, then answers
    outcome = calc.episode(ask, [{"role": "user", "content": "What is (47 + 86) * 12 - 5?"}, *made], 1591, 5)
    assert (outcome.reward, outcome.calls, outcome.turns) == (1.0, 1, 2)


def test_the_chain_example_is_made_by_the_environments_own_calculator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    agent = load("calc_agent")
    replies = calc.Replies(one_at_a_time=True, echo=True)
    opened = agent.opening("What is (47 + 86) * 12?", tools=True, example="chain",
                           instruction=calc.CHAIN_INSTRUCTION, replies=replies)
    assert [m["role"] for m in opened] == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert opened[1:5] == calc.made_calls([12, 34, 5], ["+", "-"], 2, replies)
    assert opened[4]["content"] == "calculator: 46 - 5 = 41" and opened[5]["content"] == "The answer is 41."
