"""Generate small Python repositories, each with one bug and a failing test, as dataset rows.

    python make_repos.py SEED OUT.jsonl [COUNT]

Each row: `input` is the task text (one user message); `metadata` carries the repository (`repo`: file
name → text, one module and its test) and `test_command` (`python test_<module>.py`, plain asserts, exit 0
when the bug is fixed); `solution` is a shell command that fixes the bug by rewriting the module (tests
use it; the agent never sees it). The same seed gives byte-identical output: `data.jsonl` here is
`python make_repos.py 0 data.jsonl 16`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODULES = ("mathutils", "calc", "numbers_lib", "helpers", "ops", "tools")


@dataclass(frozen=True)
class Bug:
    """One kind of bug: the correct function, its buggy line, the fix, and a test of `count` cases."""

    name: str
    """Function name."""
    params: str
    """Its parameter list."""
    good: str
    """The correct return expression."""
    bad: str
    """The buggy return expression the repository ships."""
    cases: Callable[[random.Random], list[tuple[str, str]]]
    """(call arguments, expected value) pairs, drawn from the seed."""


def _pairs(rng: random.Random, f: Callable[[int, int], object]) -> list[tuple[str, str]]:
    out = []
    for _ in range(3):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        out.append((f"{a}, {b}", repr(f(a, b))))
    return out


def _singles(rng: random.Random, f: Callable[[int], object]) -> list[tuple[str, str]]:
    return [(str(n), repr(f(n))) for n in rng.sample(range(1, 60), 3)]


def _words(rng: random.Random, f: Callable[[str], object]) -> list[tuple[str, str]]:
    words = rng.sample(["apple", "river", "stone", "cloud", "lemon", "tiger", "piano", "orbit"], 3)
    return [(repr(w), repr(f(w))) for w in words]


BUGS = (
    Bug("add", "a, b", "a + b", "a - b", lambda r: _pairs(r, lambda a, b: a + b)),
    Bug("multiply", "a, b", "a * b", "a + b", lambda r: _pairs(r, lambda a, b: a * b)),
    Bug("larger", "a, b", "a if a > b else b", "a if a < b else b", lambda r: _pairs(r, max)),
    Bug("is_even", "n", "n % 2 == 0", "n % 2 == 1", lambda r: _singles(r, lambda n: n % 2 == 0)),
    Bug("square", "n", "n * n", "n * 2", lambda r: _singles(r, lambda n: n * n)),
    Bug("reverse", "s", "s[::-1]", "s", lambda r: _words(r, lambda s: s[::-1])),
    Bug("shout", "s", "s.upper() + '!'", "s.lower() + '!'", lambda r: _words(r, lambda s: s.upper() + "!")),
)


def make_row(rng: random.Random) -> dict:
    """One repository: a module with the buggy function and a test file calling it."""
    bug, module = rng.choice(BUGS), rng.choice(MODULES)
    source = f"def {bug.name}({bug.params}):\n    return {bug.bad}\n"
    checks = "".join(f"    assert {bug.name}({args}) == {want}, {bug.name}({args})\n" for args, want in bug.cases(rng))
    test = (f"from {module} import {bug.name}\n\n\ndef test_{bug.name}():\n{checks}\n\n"
            f"if __name__ == \"__main__\":\n    test_{bug.name}()\n    print(\"OK\")\n")
    command = f"python test_{module}.py"
    task = (f"The test `{command}` fails: `{bug.name}` in {module}.py returns wrong results. "
            f"Fix {module}.py (not the test) so that the test passes.")
    solution = f"cat > {module}.py <<'EOF'\ndef {bug.name}({bug.params}):\n    return {bug.good}\nEOF"
    return {"input": task,
            "metadata": {"repo": {f"{module}.py": source, f"test_{module}.py": test}, "test_command": command},
            "solution": solution}


def make_rows(seed: int, count: int = 16) -> list[dict]:
    rng = random.Random(seed)
    return [make_row(rng) for _ in range(count)]


def write(seed: int, out: Path, count: int = 16) -> None:
    out.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in make_rows(seed, count)))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit("usage: python make_repos.py SEED OUT.jsonl [COUNT]")
    write(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) == 4 else 16)
