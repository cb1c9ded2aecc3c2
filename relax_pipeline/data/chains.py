"""Chained arithmetic problems for `dataset=arith` with `steps`: problems whose answer needs several dependent
two-number operations, `47 * 86 + 12` or `(47 + 86) * 12 - 5`.

A chain is left-deep: numbers `n0..nk` and operations `op1..opk`, evaluated as `((n0 op1 n1) op2 n2) ...`, so
a calculator that takes two numbers needs `k` calls and each call after the first takes the value of the one
before it. It is written with the fewest parentheses that keep that order (`(a + b) * c`, `a * b + c`).
`ChainSet` draws each split with its own seeded generator, heldout first, then validation, then train, each
avoiding the problems drawn before it, so no two splits share a problem and the held-out split depends only on
the seed, the operations, the operand range, its size and its step counts. A split's problem `i` needs
`steps[i % len(steps)]` calls: `[1, 2, 3]` gives equal thirds, repeats weigh the mix (`[1, 2, 2, 3]`).

What it does not do: enumerate the problem space (it is drawn; a draw that repeats is drawn again), division,
or operator precedence beyond what the parentheses above express.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
MAX_DRAWS = 100
"""Draws of one problem before the space counts as exhausted (every draw repeated an earlier problem)."""


@dataclass(frozen=True)
class Chain:
    """One chained problem: `numbers[0] ops[0] numbers[1] ops[1] numbers[2] ...`, evaluated left to right."""

    numbers: tuple[int, ...]
    ops: tuple[str, ...]

    @property
    def steps(self) -> int:
        """Calculator calls the problem needs (its operations)."""
        return len(self.ops)

    def values(self) -> list[int]:
        """The value after each operation; the last is the answer."""
        values, value = [], self.numbers[0]
        for op, number in zip(self.ops, self.numbers[1:], strict=True):
            value = OPERATIONS[op](value, number)
            values.append(value)
        return values

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def text(self) -> str:
        """The expression with the parentheses its left-to-right order needs: `(12 + 34) * 5 - 6`."""
        text, low_precedence = str(self.numbers[0]), False
        for op, number in zip(self.ops, self.numbers[1:], strict=True):
            if op == "*" and low_precedence:
                text = f"({text})"
            text, low_precedence = f"{text} {op} {number}", op != "*"
        return text


class ChainSet:
    """The three disjoint seeded splits of chained problems (`dataset.steps`, `dataset.train_steps`)."""

    def __init__(self, operations: Sequence[str], low: int, high: int, steps: Sequence[int],
                 train_steps: Sequence[int], sizes: dict[str, int], seed: int) -> None:
        _check(steps, "steps")
        _check(train_steps, "train_steps")
        self.operations, self.low, self.high, self.seed = tuple(operations), low, high, seed
        self.steps = {"heldout": tuple(steps), "validation": tuple(steps), "train": tuple(train_steps)}
        self.sizes = sizes

    def split(self, name: str) -> list[Chain]:
        """The problems of split `name`, in draw order (drawing the splits before it, which it avoids)."""
        seen: set[Chain] = set()
        for split in ("heldout", "validation", "train"):
            problems = self._draw(split, seen)
            if split == name:
                return problems
        raise ValueError(f"dataset.split={name!r}; choose one of ['train', 'validation', 'heldout']")

    def _draw(self, split: str, seen: set[Chain]) -> list[Chain]:
        rng, steps, problems = random.Random(f"arith-chain-{split}-{self.seed}"), self.steps[split], []
        for i in range(self.sizes[split]):
            for _ in range(MAX_DRAWS):
                chain = self._chain(rng, steps[i % len(steps)])
                if chain not in seen:
                    break
            else:
                raise ValueError(f"dataset.{split}_size={self.sizes[split]} exhausts the chained problems of "
                                 f"dataset.low={self.low}..high={self.high}; lower the sizes or widen the range")
            seen.add(chain)
            problems.append(chain)
        return problems

    def _chain(self, rng: random.Random, steps: int) -> Chain:
        numbers = tuple(rng.randint(self.low, self.high) for _ in range(steps + 1))
        return Chain(numbers, tuple(rng.choice(self.operations) for _ in range(steps)))


def _check(steps: Sequence[int], key: str) -> None:
    if not steps or any(not isinstance(s, int) or s < 1 for s in steps):
        raise ValueError(f"dataset.{key}={list(steps)}; list the calls a problem needs, each at least 1 "
                         "(for example [1, 2, 3])")
