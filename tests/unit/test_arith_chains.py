"""Chained arithmetic problems (`dataset=arith` with `steps`, data/chains.py): the expression's order, the answer,
disjoint seeded splits, the calls-needed mix and its curriculum, the `arith:<split>:<calls>` eval path."""

from __future__ import annotations

import dataclasses

import pytest

from relax_pipeline.data.arith import ArithDataset
from relax_pipeline.data.chains import Chain, ChainSet
from relax_pipeline.data.settings import ArithSettings

SETTINGS = ArithSettings(operations=["+", "-", "*"], low=10, high=99, steps=[1, 2, 3], train_steps=[1, 2, 2, 3],
                         heldout_size=30, validation_size=30, train_size=400, prompt="What is {expression}?")


@pytest.mark.parametrize("chain, text, values", [
    (Chain((47, 86, 12), ("+", "*")), "(47 + 86) * 12", [133, 1596]),
    (Chain((47, 86, 12), ("*", "+")), "47 * 86 + 12", [4042, 4054]),
    (Chain((47, 86, 12, 5), ("-", "*", "-")), "(47 - 86) * 12 - 5", [-39, -468, -473]),
    (Chain((2, 3, 4, 5), ("+", "*", "*")), "(2 + 3) * 4 * 5", [5, 20, 100]),
    (Chain((2, 3, 4, 5), ("*", "+", "*")), "(2 * 3 + 4) * 5", [6, 10, 50]),
    (Chain((2, 3), ("-",)), "2 - 3", [-1]),
])
def test_a_chain_is_written_so_that_its_left_to_right_order_is_the_arithmetic_one(
        chain: Chain, text: str, values: list[int]) -> None:
    assert (chain.text(), chain.values(), chain.answer, chain.steps) == (text, values, values[-1], len(values))
    assert eval(text) == chain.answer  # noqa: S307 - the written precedence gives the same value


def dataset(split: str, **changes: object) -> ArithDataset:
    return ArithDataset(dataclasses.replace(SETTINGS, path=f"arith:{split}", **changes))


def test_the_splits_are_disjoint_and_fixed() -> None:
    texts = {split: [p.input for p in dataset(split).prompts] for split in ("heldout", "validation", "train")}
    assert [len(t) for t in texts.values()] == [30, 30, 400]
    assert len(set().union(*map(set, texts.values()))) == 460
    assert [p.input for p in dataset("heldout", validation_size=10, train_size=50).prompts] == texts["heldout"]
    assert [p.input for p in dataset("heldout", seed=1).prompts] != texts["heldout"]


def test_each_split_cycles_through_its_calls_needed_and_train_has_the_curriculum_mix() -> None:
    heldout = dataset("heldout").prompts
    assert [p.metadata["steps"] for p in heldout[:6]] == [1, 2, 3, 1, 2, 3]
    train = [p.metadata["steps"] for p in dataset("train").prompts]
    assert (train.count(1), train.count(2), train.count(3)) == (100, 200, 100)
    row = heldout[1]
    assert row.input == f"What is {row.metadata['expression']}?"
    assert row.metadata["answer"] == eval(row.metadata["expression"])  # noqa: S307
    assert row.metadata["split"] == "heldout"


def test_an_eval_path_selects_the_problems_needing_that_many_calls() -> None:
    two = dataset("heldout:2").prompts
    assert len(two) == 10 and {p.metadata["steps"] for p in two} == {2}
    assert [p.input for p in two] == [p.input for p in dataset("heldout").prompts if p.metadata["steps"] == 2]


@pytest.mark.parametrize("changes, key", [
    ({"steps": [0, 2]}, "dataset.steps=[0, 2]"), ({"train_steps": []}, "dataset.train_steps=[]"),
    ({"train_size": None}, "dataset.train_size=null"), ({"low": 1, "high": 2, "steps": [1]}, "exhausts"),
])
def test_bad_chain_settings_name_the_key(changes: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        dataset("heldout", **changes)


def test_a_calls_needed_path_on_single_problems_or_a_bad_one_names_the_fix() -> None:
    with pytest.raises(ValueError, match="set dataset.steps"):
        ArithDataset(ArithSettings(path="arith:heldout:2"))
    with pytest.raises(ValueError, match="arith:heldout:2"):
        dataset("heldout:two")


def test_chain_set_draws_the_split_asked_for() -> None:
    sizes = {"heldout": 3, "validation": 2, "train": 4}
    chains = ChainSet(["*"], 10, 99, [2], [1], sizes, 0)
    assert [c.steps for c in chains.split("train")] == [1, 1, 1, 1] and len(chains.split("validation")) == 2
    with pytest.raises(ValueError, match="dataset.split='test'"):
        chains.split("test")


def test_train_given_makes_some_calls_for_train_problems_only() -> None:
    train = dataset("train", train_given=True).prompts
    assert all(0 <= p.metadata["given"] < p.metadata["steps"] for p in train)
    assert {p.metadata["given"] for p in train if p.metadata["steps"] == 3} == {0, 1, 2}
    assert all(p.metadata["given"] == 0 for p in dataset("heldout", train_given=True).prompts)
    assert all(p.metadata["given"] == 0 for p in dataset("train").prompts)
    row = train[0]
    assert len(row.metadata["numbers"]) == len(row.metadata["ops"]) + 1 == row.metadata["steps"] + 1
