"""The runnable-block extractor of the docs tier (`relax_pipeline/reference/doc_commands.py`): a page with a runnable
block, a plain one and malformed markers; nothing is run here."""

from __future__ import annotations

import pytest

from relax_pipeline.reference.doc_commands import MARKER, Block, MalformedBlock, blocks, pages

PAGE = f"""# A page

```bash
echo not marked
```

{MARKER}
```bash
python -m relax_pipeline --cfg job
echo "two lines"
```

- a list item
  {MARKER}
  ```bash
  echo indented
  ```
"""


def test_only_marked_bash_blocks_are_runnable_with_their_fence_line() -> None:
    found = blocks(PAGE, "docs/page.md")
    assert found == [
        Block("docs/page.md", 8, 'python -m relax_pipeline --cfg job\necho "two lines"\n'),
        Block("docs/page.md", 15, "echo indented\n"),
    ]
    assert found[0].where == "docs/page.md:8"


@pytest.mark.parametrize(("text", "line", "says"), [
    (f"{MARKER}\n\n```bash\necho hi\n```\n", 1, "right above"),
    (f"text\n{MARKER}\n```python\nprint(1)\n```\n", 2, "'```python'"),
    (f"{MARKER}\n```bash\necho never closed\n", 2, "never closed"),
    (f"{MARKER}", 1, "right above"),
])
def test_a_malformed_marker_names_the_page_and_line(text: str, line: int, says: str) -> None:
    with pytest.raises(MalformedBlock, match=f"^docs/bad.md:{line}: .*{says}"):
        blocks(text, "docs/bad.md")


def test_a_page_without_markers_has_no_runnable_block() -> None:
    assert blocks("```bash\nrm -rf /\n```\n", "README.md") == []


def test_the_pages_are_the_readme_and_everything_under_docs(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "docs" / "how-to").mkdir(parents=True)
    for name in ("README.md", "docs/index.md", "docs/how-to/eval.md", "docs/notes.txt"):
        (tmp_path / name).write_text("x")
    assert [p.relative_to(tmp_path).as_posix() for p in pages(tmp_path)] == [
        "README.md", "docs/how-to/eval.md", "docs/index.md"]
