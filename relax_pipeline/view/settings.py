"""The `view` node as one record (`ViewSettings`), and the folder `job=view` shows, checked before it serves.

`ViewSettings.folder` picks `view.dir` (else the run's `output_dir`) and refuses, naming the key, the value and
the fix, a path that does not exist, is not a folder, or is a folder that holds neither a run (`config.yaml`,
`run.log`, `metrics.jsonl` or a dump file) nor a replay bundle (`bundle.json`). Serving is `view/server.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

from relax_pipeline.tracking.metrics_file import METRICS_FILE
from relax_pipeline.view.bundle import is_bundle

RUN_FILES = ("config.yaml", "run.log", METRICS_FILE)
"""Files of which a run folder holds at least one (or a dump file)."""


@dataclass
class ViewSettings:
    """`job=view`: the run viewer (`relax_pipeline/view/`) over a finished or running run's output folder."""

    dir: str | None = None
    """The run's output folder to show; None shows `output_dir`."""
    host: str = "127.0.0.1"
    """Where the viewer listens; only this machine by default."""
    port: int = 8765
    """The viewer's port; 0 picks a free one (the log line says which)."""
    tokenizer: str | None = None
    """Hugging Face folder whose tokenizer turns token ids into text; None finds the run's (its newest
    checkpoint, else `model.path` or the built tiny model named in its config.yaml)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"view.port={self.port} is not a TCP port; use 0 (a free port) or 1-65535")

    def folder(self, output_dir: str | None) -> Path:
        """The folder to show: `view.dir`, else `output_dir`; checked (see the module)."""
        key, given = ("view.dir", self.dir) if self.dir else ("output_dir", output_dir)
        if not given:
            raise ValueError("job=view needs the run folder: view.dir=PATH (or output_dir=PATH)")
        folder = Path(given).expanduser()
        fix = "point it at a run's output folder (or a <output>/replay/step_<n> bundle)"
        if not folder.exists():
            raise ValueError(f"{key}={given!r} does not exist: {fix}")
        if not folder.is_dir():
            raise ValueError(f"{key}={given!r} is a file, not a folder: {fix}")
        if not (is_bundle(folder) or _holds_a_run(folder)):
            raise ValueError(f"{key}={given!r} holds no run ({', '.join(RUN_FILES)} or a dump file) and no replay "
                             f"bundle (bundle.json): {fix}")
        return folder


def _holds_a_run(folder: Path) -> bool:
    """A run's files, or `.jsonl` files in it or one level below (its dump, wherever the pattern put it)."""
    if any((folder / name).is_file() for name in RUN_FILES):
        return True
    return next(islice(chain(folder.glob("*.jsonl"), folder.glob("*/*.jsonl")), 1), None) is not None
