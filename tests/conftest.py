"""Shared fixtures (the tiny models built once per test run, the text model's tokenizer and chat template) and
the tier markers: every test under `tests/unit`, `tests/integration`, `tests/e2e`, `tests/harness`, `tests/browser`,
`tests/fuzz` or `tests/soak` carries that folder's marker, so `pytest -m unit` runs the fast tier (no server, no
subprocess) in well under a minute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relax_pipeline.engine.template import ChatTemplate
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


TIERS = ("unit", "integration", "e2e", "harness", "browser", "fuzz", "soak")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's tier."""
    for item in items:
        tier = next((part for part in Path(str(item.fspath)).parts if part in TIERS), None)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
