"""Prints the fuzz tier's figures (cases tried per operation, responses with status 500) in pytest's summary."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    module = sys.modules.get("test_gateway_fuzz")
    if module is None or not module.SEEN:
        return
    seen = dict(module.SEEN)
    errors = seen.pop("500", 0)
    terminalreporter.write_line(f"fuzz: {sum(seen.values())} cases tried over {len(seen)} operations {seen}; "
                                f"{errors} responses with status 500")
