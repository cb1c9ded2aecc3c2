"""The reference pages cannot drift: each committed page of docs/reference/ is what the code generates now.

One test per page (`relax_pipeline/reference/pages.py`'s `PAGES`): it renders the page from the code (the typed
config records, the composed default run and presets, the OpenAPI document, the transfer stage, the replay format,
a scan of metric names) and fails with the start of the diff and the one command that regenerates them all,
`.venv/bin/python -m relax_pipeline.reference`. The other tests check what the pages stand on: every config key has
its docstring, design §3.4's dump field list is the transfer stage's, the metric scan expands a loop it can evaluate
and keeps a placeholder where it cannot, and a job nothing describes is named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from relax_pipeline import config
from relax_pipeline.reference import cli_page, formats_page, metrics_page, pages
from relax_pipeline.reference.records import sections

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", list(pages.PAGES))
def test_committed_reference_page_is_what_the_code_generates(page: str) -> None:
    problem = pages.difference(page)
    assert not problem, problem


def test_every_config_key_has_a_docstring() -> None:
    records = [config.Config, *(r for kinds in config.SCHEMAS.values() for r in kinds.values())]
    bare = sorted({f"{k.record.__module__}.{k.record.__name__}.{k.key.rsplit('.', 1)[-1]}"
                   for record in records for section in sections(record, "") for k in section.keys if not k.doc})
    assert not bare, f"give these config fields a one-line docstring under the field (STYLE.md, habit 2): {bare}"


def test_design_lists_exactly_the_dump_fields_the_transfer_stage_writes() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    listed = re.search(r"with exactly these fields:\s*`([^`]+)`", design)
    assert listed, "docs/design.md §3.4 no longer lists the dump's fields after 'with exactly these fields:'"
    named = {name.strip() for name in re.sub(r"\([^)]*\)", "", listed.group(1)).split(",")}
    every_row = {name for name, kinds in formats_page.dump_fields().items() if kinds == {"context", "session"}}
    assert named == every_row, (f"docs/design.md §3.4 and stages/transfer.py disagree: only in the design "
                                f"{sorted(named - every_row)}, only in the code {sorted(every_row - named)}")


def _names(source: str) -> set[str]:
    tree = ast.parse(source)
    return {name for name, _ in metrics_page._names(tree, "relax_pipeline.reference.metrics_page")}


def test_metric_scan_expands_a_loop_over_module_values_and_keeps_a_placeholder_otherwise() -> None:
    found = _names('for x in NAMESPACES:\n    m[f"rollout/seen/{x}"] = 1\n'
                   'for y in rows():\n    m[f"rollout/kept/{y}"] = 1\n')
    assert {f"rollout/seen/{n}" for n in metrics_page.NAMESPACES} <= found
    assert "rollout/kept/<y>" in found


def test_metric_scan_folds_a_placeholder_into_the_names_a_loop_expanded() -> None:
    found = {"rollout/outcome/a": {"x.py"}, "rollout/outcome/b": {"x.py"}, "rollout/outcome/<o>": {"y.py"},
             "rollout/<name>": {"z.py"}}
    merged = metrics_page.merged(found, {"rollout/outcome/a", "rollout/outcome/b"})
    assert merged == {"rollout/outcome/a": {"x.py", "y.py"}, "rollout/outcome/b": {"x.py", "y.py"},
                      "rollout/<name>": {"z.py"}}


def test_every_job_is_described_and_an_undescribed_one_is_named() -> None:
    assert all(cli_page.summary(cli_page.job_about(job)) for job in config.JOBS)
    with pytest.raises(ValueError, match="job=no_such_job .* described nowhere"):
        cli_page.job_about("no_such_job")
