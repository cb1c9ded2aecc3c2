"""The docs' runnable commands: every ```` ```bash ```` block whose previous line is exactly `<!-- runnable -->`.

`blocks(text, page)` finds them in one Markdown page (a marker not followed by a ```` ```bash ```` fence, or a
runnable fence never closed, raises `MalformedBlock` naming the page and the line); `runnable(root)` collects them
from `README.md` and `docs/**/*.md`. `Workspace(root).run(block)` runs one the way the docs tier (`tests/docs`)
does: `bash -euo pipefail` on the block's text, in a temporary folder that mirrors the repository root (a symlink to
each of its top-level entries; the ignored output folders `outputs/`, `multirun/` and `out/` left out), one folder
per page, its blocks run there in order. So a command written for the repository root (`python -m relax_pipeline
...`, `examples/...`) runs as written, a later block sees what an earlier one wrote, and what they write (Hydra's
`outputs/<date>/<time>/`, a relative `output_dir=...`) lands in the temporary folder, never in the checkout. `HOME`
is a temporary folder too; built models stay shared through `RELAX_CACHE_DIR` (the caller's, else its
`~/.cache/relax_pipeline`); the venv's `bin/` leads `PATH`; `RELAX_DOCS_TMP` names the page's temporary folder. A
block that runs past its timeout, or whose caller is interrupted, has its whole process group killed.

What it does not do: decide which commands deserve a marker (the pages' authors: keep each small, a tiny model and
a step or two, well under two minutes on two cores).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "<!-- runnable -->"
FENCE = "```bash"
LEFT_OUT = ("outputs", "multirun", "out", ".git")
"""Top-level entries of the repository a block's folder does not mirror (where runs write, and git's own)."""


class MalformedBlock(ValueError):
    """A `<!-- runnable -->` marker that does not mark a whole ```` ```bash ```` block."""


@dataclass(frozen=True)
class Block:
    """One runnable block: its page (a path from the repository root), the line of its fence, its commands."""

    page: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(text: str, page: str) -> list[Block]:
    """The runnable blocks of one Markdown page, in order."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = lines[index + 1] if index + 1 < len(lines) else ""
        if fence.strip() != FENCE:
            raise MalformedBlock(f"{page}:{index + 1}: {MARKER} must be the line right above a {FENCE} fence "
                                 f"(found {fence.strip()!r})")
        indent = fence[:len(fence) - len(fence.lstrip())]
        end = next((j for j in range(index + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise MalformedBlock(f"{page}:{index + 2}: the runnable {FENCE} block is never closed with ```")
        body = [line.removeprefix(indent) for line in lines[index + 2:end]]
        found.append(Block(page, index + 2, "\n".join(body) + "\n"))
    return found


def pages(root: Path) -> list[Path]:
    """README.md and every page under docs/, in a fixed order."""
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    return readme + sorted((root / "docs").rglob("*.md"))


def runnable(root: Path) -> list[Block | MalformedBlock]:
    """Every runnable block of the docs, and each malformed marker as its error (the docs tier fails on it)."""
    out: list[Block | MalformedBlock] = []
    for path in pages(root):
        try:
            out += blocks(path.read_text(), path.relative_to(root).as_posix())
        except MalformedBlock as error:
            out.append(error)
    return out


@dataclass(frozen=True)
class Ran:
    """What one block did: its exit status (None when it ran past its timeout) and its output."""

    status: int | None
    output: str


class Workspace:
    """The folder one page's blocks run in, in order (a later block sees what an earlier one wrote, as a reader's
    shell would): a mirror of the repository root, a `HOME` of its own, removed by `close`."""

    def __init__(self, root: Path) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="relax-docs-"))
        self.work, self.home = self.tmp / "repo", self.tmp / "home"
        _mirror(root, self.work)
        self.home.mkdir()

    def run(self, block: Block, timeout_s: float) -> Ran:
        """Run `block` as the module docstring says; its output is stdout and stderr together. Its process group
        is killed if it runs past `timeout_s` or the caller is interrupted."""
        script = self.tmp / f"block_{block.line}.sh"
        script.write_text(block.text)
        process = subprocess.Popen(["bash", "-euo", "pipefail", str(script)], cwd=self.work,
                                   env=_env(self.home, self.tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout_s)
            return Ran(process.returncode, output)
        except subprocess.TimeoutExpired:
            _kill(process)
            return Ran(None, process.communicate()[0])
        finally:
            _kill(process)

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kill(process: subprocess.Popen[str]) -> None:
    """SIGKILL the block's whole process group (whatever it started in the background too)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _mirror(root: Path, work: Path) -> None:
    work.mkdir()
    for entry in sorted(root.iterdir()):
        if entry.name not in LEFT_OUT:
            (work / entry.name).symlink_to(entry)


def _env(home: Path, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    cache = env.get("RELAX_CACHE_DIR") or str(Path.home() / ".cache" / "relax_pipeline")
    venv_bin = str(Path(sys.executable).parent)
    env.update(HOME=str(home), RELAX_CACHE_DIR=cache, RELAX_DOCS_TMP=str(tmp), PYTHONDONTWRITEBYTECODE="1",
               PATH=venv_bin + os.pathsep + env.get("PATH", ""))
    return env


def tail(output: str, lines: int = 40) -> str:
    """The last `lines` lines of a block's output."""
    return "\n".join(output.splitlines()[-lines:])

