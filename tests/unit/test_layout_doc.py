"""`docs/layout.md` quotes the floors as `relax_pipeline/floors.py` renders them, lists every module of the package
under its own package, and no module that is gone.

The "Modules" section of the page has one heading per package (`` ### `relax_pipeline/train/` ``) and one
bullet per module or group of modules: the names in backticks before the first " — " (`` - `rank_ray.py` — ``),
the description after it (which may name any file). This test walks `relax_pipeline/**/*.py`
(package `__init__.py` files and the `conf/` folder left out) and fails naming every module the page does
not list under its package, and every module the page lists that no longer exists. It reads files only.
"""

from __future__ import annotations

import re
from pathlib import Path

import relax_pipeline
from relax_pipeline import floors

ROOT = Path(relax_pipeline.__file__).parent
LAYOUT = ROOT.parent / "docs" / "layout.md"
HEADING = re.compile(r"^### `relax_pipeline/(?P<package>[\w/]*)`")
MODULE = re.compile(r"`(?P<name>\w+\.py)`")


def package_modules() -> set[str]:
    """Every module of the package as `package/name.py` (`name.py` at the top), `__init__.py` and conf/ left out."""
    found = set()
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if path.name != "__init__.py" and relative.parts[0] != "conf":
            found.add(relative.as_posix())
    return found


def listed_modules(text: str) -> set[str]:
    """The modules the page's "Modules" section names, each as `package/name.py` under its heading."""
    section = text.split("\n## Modules", 1)[-1].split("\n## ", 1)[0]
    listed: set[str] = set()
    package: str | None = None
    for line in section.splitlines():
        heading = HEADING.match(line)
        if heading:
            package = heading["package"]
        elif package is not None:
            names = line.split(" — ", 1)[0] if line.startswith("- ") else ""
            listed.update(package + name for name in MODULE.findall(names))
    return listed


def test_layout_doc_lists_every_module() -> None:
    listed = listed_modules(LAYOUT.read_text())
    missing = sorted(package_modules() - listed)
    assert not missing, (
        "modules missing from docs/layout.md (add a line under the package's heading in its Modules section):\n"
        + "\n".join(f"  relax_pipeline/{name}" for name in missing))


def test_layout_doc_lists_no_module_that_is_gone() -> None:
    listed = listed_modules(LAYOUT.read_text())
    gone = sorted(listed - package_modules())
    assert not gone, "docs/layout.md lists modules that do not exist (remove or rename them):\n" + "\n".join(
        f"  relax_pipeline/{name}" for name in gone)


def test_listed_modules_reads_headings_and_names() -> None:
    text = "# x\n## Modules\n### `relax_pipeline/`\n- `run.py` builds\n### `relax_pipeline/train/`\n" \
           "- `rank_ray.py`, `step.py` — `run.py` calls them\n  `wrapped.py`\n## Other\n- `gone.py`\n"
    assert listed_modules(text) == {"run.py", "train/rank_ray.py", "train/step.py"}


def test_layout_doc_quotes_the_floor_list() -> None:
    """The Floors section's code block is `floors.render()`, so the page cannot restate the list differently."""
    section = LAYOUT.read_text().split("\n## Floors", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n", 2)[1].rstrip("\n")
    assert block == floors.render(), "docs/layout.md's floor block differs from relax_pipeline/floors.py; paste " \
        "the output of: python -c 'from relax_pipeline import floors; print(floors.render())'"
