"""The docs tier: every command the docs mark runnable runs, so a page cannot keep a command that no longer works.

A ```` ```bash ```` block whose previous line is exactly `<!-- runnable -->`, in README.md or any page under docs/,
is one test (its id: the page and the fence's line). It runs with `bash -euo pipefail` in a temporary folder that
mirrors the repository root, one per page (its blocks run there in page order, so a later step sees an earlier
one's files), with a temporary `HOME` and the venv's `bin/` first on `PATH`
(`relax_pipeline/reference/doc_commands.py`), so what it writes never lands in the checkout. A block that exits
non-zero, or runs past `RELAX_DOCS_TIMEOUT_S` seconds (default 240), fails naming the page, the line, the command
and the tail of its output; a malformed marker fails too. Run it: `pytest -m docs tests/docs` (not in the default
selection: each block is a real command).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_pipeline.reference.doc_commands import Block, MalformedBlock, Workspace, runnable, tail

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = float(os.environ.get("RELAX_DOCS_TIMEOUT_S", "240"))
FOUND = runnable(REPO)


def _id(item: Block | MalformedBlock) -> str:
    return item.where if isinstance(item, Block) else str(item).split(": ", 1)[0]


@pytest.fixture(scope="module")
def workspaces() -> Iterator[dict[str, Workspace]]:
    """One workspace per page, removed at the end."""
    opened: dict[str, Workspace] = {}
    yield opened
    for workspace in opened.values():
        workspace.close()


@pytest.mark.parametrize("item", FOUND, ids=[_id(item) for item in FOUND])
def test_runnable_block_runs(item: Block | MalformedBlock, workspaces: dict[str, Workspace]) -> None:
    if isinstance(item, MalformedBlock):
        pytest.fail(str(item), pytrace=False)
    workspace = workspaces.get(item.page) or workspaces.setdefault(item.page, Workspace(REPO))
    ran = workspace.run(item, TIMEOUT_S)
    if ran.status != 0:
        why = f"ran past {TIMEOUT_S:.0f} s (RELAX_DOCS_TIMEOUT_S)" if ran.status is None else f"exited {ran.status}"
        pytest.fail(f"{item.where}: the runnable command {why}:\n{item.text}--- its output, last lines ---\n"
                    f"{tail(ran.output)}", pytrace=False)


def test_the_docs_mark_some_command_runnable() -> None:
    assert any(isinstance(item, Block) for item in FOUND), (
        "no page marks a command runnable: put <!-- runnable --> on the line above a ```bash block")
