"""`dataset=arith`: seeded, generated arithmetic problems with a fixed held-out split.

The problem space is every `a <op> b` with `a, b` in `[low, high]` and `op` in `operations` (`+`, `-`, `*`).
`seed` (the problem set's own seed, independent of the run's `seed`, so every run evaluates on the same
problems) draws `heldout_size` problems for the held-out split; the train split is `train_size` other
problems (null: all of them), so the two never share a problem. The held-out split depends only on
`seed`, `operations`, `low`, `high` and `heldout_size`: changing `train_size` does not move it. Each row's
prompt is `prompt` filled in (`What is 12 + 34? Answer with just the number.`) and its metadata holds
`answer` (an int), `a`, `op`, `b` and `split`.

`ArithDataset` is a drop-in for `JsonlDataset` (`prompts`, `len`, `shuffle`). As an eval dataset it is
built with the entry's `path`: `arith:heldout` (or `arith:train`) selects a generated split, any other path
is read as a JSONL file like `dataset=digits` does (`eval.datasets=[{name: heldout, path: "arith:heldout"}]`).
What it does not do: score answers (`credit.examples.exact_answer`), division, or operands beyond what an
int holds exactly.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Callable

from relax_pipeline.data.dataset import JsonlDataset, Prompt
from relax_pipeline.data.settings import ArithSettings

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SPLITS = ("train", "heldout")
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
        split = path[len(SPLIT_PREFIX):] if path is not None else settings.split
        self.problems = ProblemSet(tuple(settings.operations), settings.low, settings.high, settings.heldout_size,
                                   settings.train_size, settings.seed)
        self.prompts = [self._prompt(i, problem, split, settings.prompt) for i, problem in
                        enumerate(self.problems.split(split))]

    @staticmethod
    def _prompt(index: int, problem: tuple[int, str, int], split: str, template: str) -> Prompt:
        a, op, b = problem
        text = template.format(a=a, op=op, b=b)
        return Prompt(index, text, {"answer": OPERATIONS[op](a, b), "a": a, "op": op, "b": b, "split": split})

    def __len__(self) -> int:
        return len(self.prompts)


class ProblemSet:
    """The seeded problem space and its two disjoint splits; a problem is an `(a, op, b)` triple."""

    def __init__(self, operations: tuple[str, ...], low: int, high: int, heldout_size: int,
                 train_size: int | None, seed: int) -> None:
        _check(operations, low, high, heldout_size, train_size)
        self.operations, self.low, self.width = operations, low, high - low + 1
        self.size = len(operations) * self.width**2
        """Number of distinct problems."""
        if heldout_size >= self.size:
            raise ValueError(f"dataset.heldout_size={heldout_size} leaves no training problems: the problem space "
                             f"has {self.size}; lower it or widen dataset.low/high/operations")
        self.heldout_size, self.train_size, self.seed = heldout_size, train_size, seed

    def split(self, name: str) -> list[tuple[int, str, int]]:
        """The problems of split `name` (`train` or `heldout`), in generation order."""
        if name not in SPLITS:
            raise ValueError(f"dataset.split={name!r}; choose one of {list(SPLITS)} (eval path: arith:<split>)")
        indices = self.heldout_indices() if name == "heldout" else self.train_indices()
        return [self.problem(i) for i in indices]

    def heldout_indices(self) -> list[int]:
        """`heldout_size` problem indices drawn with `seed` alone."""
        return random.Random(f"arith-heldout-{self.seed}").sample(range(self.size), self.heldout_size)

    def train_indices(self) -> list[int]:
        """`train_size` (default: every) problem outside the held-out split, in a seeded order."""
        rest = self.size - self.heldout_size
        count = rest if self.train_size is None else self.train_size
        if count > rest or (self.train_size is None and rest > MAX_ENUMERATED):
            raise ValueError(f"dataset.train_size={self.train_size}: the problem space has {rest} problems outside "
                             f"the held-out split; set dataset.train_size to at most {min(rest, MAX_ENUMERATED)}")
        heldout = sorted(self.heldout_indices())
        picks = random.Random(f"arith-train-{self.seed}").sample(range(rest), count)
        return [_nth_outside(j, heldout) for j in picks]

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


def _check(operations: tuple[str, ...], low: int, high: int, heldout_size: int, train_size: int | None) -> None:
    unknown = [op for op in operations if op not in OPERATIONS]
    if not operations or unknown or len(set(operations)) != len(operations):
        raise ValueError(f"dataset.operations={list(operations)}; use distinct ones of {list(OPERATIONS)}")
    if high < low:
        raise ValueError(f"dataset.high={high} must be at least dataset.low={low}")
    if heldout_size < 0 or (train_size is not None and train_size <= 0):
        raise ValueError(f"dataset.heldout_size={heldout_size} must be >= 0 and dataset.train_size={train_size} "
                         "positive or null")

