"""`dataset=arith`: seeded, generated arithmetic problems with a fixed held-out split.

The problem space is every `a <op> b` with `a, b` in `[low, high]` and `op` in `operations` (`+`, `-`, `*`).
`seed` (the problem set's own seed, independent of the run's `seed`, so every run evaluates on the same
problems) draws `heldout_size` problems for the held-out split, then `validation_size` others for the
validation split (the one to choose settings on); the train split is `train_size` further problems (null:
all the rest), so no two splits share a problem. The held-out split depends only on `seed`, `operations`,
`low`, `high` and `heldout_size`, and the validation split on those and `validation_size`: changing
`train_size` moves neither. With `validation_size: 0` the train split is what it was before the split existed.
Each row's prompt is `prompt` filled in (`What is 12 + 34? Answer with just the number.`) and its metadata holds
`answer` (an int), `a`, `op`, `b` and `split`.

`ArithDataset` is a drop-in for `JsonlDataset` (`prompts`, `len`, `shuffle`). As an eval dataset it is
built with the entry's `path`: `arith:heldout` (or `arith:train`) selects a generated split, any other path
is read as a JSONL file like `dataset=digits` does (`eval.datasets=[{name: heldout, path: "arith:heldout"}]`).
With `steps` (a list of call counts, `[1, 2, 3]`) the problems are chained instead (data/chains.py:
`47 * 86 + 12`, `(47 + 86) * 12`, drawn with the same three disjoint splits, a problem `i` of a split needing
`steps[i % len(steps)]` calculator calls; `train_steps` gives the train split its own mix, the curriculum),
the prompt fills `{expression}` and the metadata holds `answer`, `steps`, `expression`, `split`, `numbers`,
`ops` and `given`: with `train_given`, a train problem needing k calls has its first 0..k-1 calls made by the
environment (drawn with the seed; the agent shows them as prompt), a reverse curriculum; elsewhere 0. An eval
path `arith:heldout:2` selects the held-out problems needing two calls (one eval set per depth).
What it does not do: score answers (`credit.examples.exact_answer`), division, or operands beyond what an
int holds exactly.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

from relax_pipeline.data.chains import ChainSet
from relax_pipeline.data.dataset import JsonlDataset, Prompt
from relax_pipeline.data.settings import ArithSettings

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = ("train", "validation", "heldout")
SPLIT_PREFIX = "arith:"
"""An eval entry's `path` of the form `arith:<split>` selects a generated split."""
MAX_ENUMERATED = 1_000_000
"""Largest train split generated whole (`train_size: null`); larger problem spaces need a `train_size`."""


class ArithDataset:
    """Generated arithmetic prompts: one split of a seeded problem set, or a JSONL file given as `path`."""

    def __init__(self, settings: ArithSettings) -> None:
        self.shuffle = settings.shuffle
        path = settings.path
        if path is not None and not path.startswith(SPLIT_PREFIX):
            self.prompts = JsonlDataset(settings.jsonl()).prompts
            return
        split, steps = parse_split(path[len(SPLIT_PREFIX):] if path is not None else settings.split)
        if settings.steps is not None:
            self.prompts = chain_prompts(settings, split, steps)
            return
        if steps is not None:
            raise ValueError(f"dataset path arith:{split}:{steps} selects by calls needed, which only chained "
                             "problems have; set dataset.steps (for example [1, 2, 3]) or drop the :<calls>")
        self.problems = ProblemSet(tuple(settings.operations), settings.low, settings.high,
                                   Sizes(settings.heldout_size, settings.validation_size, settings.train_size),
                                   settings.seed)
        self.prompts = [self._prompt(i, problem, split, settings.prompt) for i, problem in
                        enumerate(self.problems.split(split))]

    @staticmethod
    def _prompt(index: int, problem: tuple[int, str, int], split: str, template: str) -> Prompt:
        a, op, b = problem
        text = template.format(a=a, op=op, b=b, expression=f"{a} {op} {b}")
        return Prompt(index, text, {"answer": OPERATIONS[op](a, b), "a": a, "op": op, "b": b, "split": split})

    def __len__(self) -> int:
        return len(self.prompts)


def parse_split(text: str) -> tuple[str, int | None]:
    """`heldout` → (`heldout`, None); `heldout:2` → (`heldout`, 2): the split and the calls its problems need."""
    split, _, steps = text.partition(":")
    if steps and not steps.isdigit():
        raise ValueError(f"dataset path arith:{text}: write arith:<split> or arith:<split>:<calls needed>, "
                         "for example arith:heldout:2")
    return split, int(steps) if steps else None


def chain_prompts(settings: ArithSettings, split: str, steps: int | None) -> list[Prompt]:
    """The chained problems of `split` (data/chains.py), those needing `steps` calls when it is given."""
    sizes = {"heldout": settings.heldout_size, "validation": settings.validation_size, "train": settings.train_size}
    if sizes["train"] is None:
        raise ValueError("dataset.train_size=null: chained problems (dataset.steps) are drawn, not enumerated; "
                         "set dataset.train_size, for example 20000")
    train_steps = settings.steps if settings.train_steps is None else settings.train_steps
    chains = ChainSet(settings.operations, settings.low, settings.high, settings.steps, train_steps, sizes,
                      settings.seed).split(split)
    picked = [c for c in chains if steps is None or c.steps == steps]
    given = random.Random(f"arith-given-{settings.seed}")
    return [Prompt(i, settings.prompt.format(expression=c.text()),
                   {"answer": c.answer, "steps": c.steps, "expression": c.text(), "split": split,
                    "numbers": list(c.numbers), "ops": list(c.ops),
                    "given": given.randrange(c.steps) if settings.train_given and split == "train" else 0})
            for i, c in enumerate(picked)]


@dataclass(frozen=True)
class Sizes:
    """How many problems each split holds (`dataset.heldout_size`, `validation_size`, `train_size`)."""

    heldout: int
    validation: int = 0
    train: int | None = None
    """None: every problem outside the other two splits."""


class ProblemSet:
    """The seeded problem space and its three disjoint splits; a problem is an `(a, op, b)` triple."""

    def __init__(self, operations: tuple[str, ...], low: int, high: int, sizes: Sizes, seed: int) -> None:
        _check(operations, low, high, sizes)
        self.operations, self.low, self.width = operations, low, high - low + 1
        self.size = len(operations) * self.width**2
        """Number of distinct problems."""
        if sizes.heldout + sizes.validation >= self.size:
            raise ValueError(f"dataset.heldout_size={sizes.heldout} and dataset.validation_size={sizes.validation} "
                             f"leave no training problems: the problem space has {self.size}; lower them or widen "
                             "dataset.low/high/operations")
        self.sizes, self.seed = sizes, seed

    def split(self, name: str) -> list[tuple[int, str, int]]:
        """The problems of split `name` (`train`, `validation` or `heldout`), in generation order."""
        if name not in SPLITS:
            raise ValueError(f"dataset.split={name!r}; choose one of {list(SPLITS)} (eval path: arith:<split>)")
        pick = {"heldout": self.heldout_indices, "validation": self.validation_indices, "train": self.train_indices}
        return [self.problem(i) for i in pick[name]()]

    def heldout_indices(self) -> list[int]:
        """`heldout_size` problem indices drawn with `seed` alone."""
        return random.Random(f"arith-heldout-{self.seed}").sample(range(self.size), self.sizes.heldout)

    def validation_indices(self) -> list[int]:
        """`validation_size` problem indices outside the held-out split, drawn with `seed` alone."""
        heldout = sorted(self.heldout_indices())
        picks = random.Random(f"arith-validation-{self.seed}").sample(range(self.size - len(heldout)),
                                                                         self.sizes.validation)
        return [_nth_outside(j, heldout) for j in picks]

    def train_indices(self) -> list[int]:
        """`train_size` (default: every) problem outside the held-out and validation splits, in a seeded order."""
        taken = sorted(self.heldout_indices() + self.validation_indices())
        rest = self.size - len(taken)
        count = rest if self.sizes.train is None else self.sizes.train
        if count > rest or (self.sizes.train is None and rest > MAX_ENUMERATED):
            raise ValueError(f"dataset.train_size={self.sizes.train}: the problem space has {rest} problems outside "
                             f"the held-out and validation splits; set dataset.train_size to at most "
                             f"{min(rest, MAX_ENUMERATED)}")
        picks = random.Random(f"arith-train-{self.seed}").sample(range(rest), count)
        return [_nth_outside(j, taken) for j in picks]

    def problem(self, index: int) -> tuple[int, str, int]:
        """Problem number `index` of the space: operation-major, then `a`, then `b`."""
        op_index, rest = divmod(index, self.width**2)
        a, b = divmod(rest, self.width)
        return self.low + a, self.operations[op_index], self.low + b


def _nth_outside(j: int, taken: list[int]) -> int:
    """The `j`-th (from 0) non-negative integer not in the sorted list `taken`."""
    lo, hi = j, j + len(taken)
    while lo < hi:
        mid = (lo + hi) // 2
        if mid + 1 - bisect.bisect_right(taken, mid) > j:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check(operations: tuple[str, ...], low: int, high: int, sizes: Sizes) -> None:
    unknown = [op for op in operations if op not in OPERATIONS]
    if not operations or unknown or len(set(operations)) != len(operations):
        raise ValueError(f"dataset.operations={list(operations)}; use distinct ones of {list(OPERATIONS)}")
    if high < low:
        raise ValueError(f"dataset.high={high} must be at least dataset.low={low}")
    if sizes.heldout < 0 or sizes.validation < 0 or (sizes.train is not None and sizes.train <= 0):
        raise ValueError(f"dataset.heldout_size={sizes.heldout} and dataset.validation_size={sizes.validation} "
                         f"must be >= 0, and dataset.train_size={sizes.train} positive or null")

