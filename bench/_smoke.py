"""`--smoke` for the benches: the smallest sizes with which a bench still prints every line it prints.

`tests/e2e/test_bench_smoke.py` runs every `bench/*.py` with `--smoke`, so a benchmark cannot silently stop running.
A smoke run takes seconds and its figures mean nothing; nothing about speed is checked. Each bench names its own
tiny sizes (`parse_args(parser, reps=2)`); a flag given on the command line still wins over them.

This module is a helper, not a bench (its name starts with `_`, which the smoke test skips).
"""

from __future__ import annotations

import argparse
from typing import Any


def parse_args(parser: argparse.ArgumentParser, **smoke: Any) -> argparse.Namespace:
    """`parser.parse_args()` with a `--smoke` flag that makes `smoke` (argument dest → value) the defaults."""
    sizes = " ".join(f"--{dest.replace('_', '-')}={value}" for dest, value in smoke.items())
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes, a few seconds, to check that the bench runs (figures mean nothing): {sizes}")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()
