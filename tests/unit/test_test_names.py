"""Every test module has a basename of its own: pytest imports test files by basename (the default `prepend`
import mode, no `__init__.py` in the test folders), so two `test_x.py` in different folders break collection of
the whole run ("import file mismatch"), which CI then reports as a tier that ran no test."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    names = Counter(path.name for path in modules)
    shared = [str(path.relative_to(TESTS)) for path in modules if names[path.name] > 1]
    assert not shared, f"give each of these a basename of its own: {shared}"
