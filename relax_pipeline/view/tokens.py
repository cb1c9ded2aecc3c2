"""Token ids → text pieces for the viewer's token strips, with the run's own tokenizer when it can be found.

Where the tokenizer comes from, first found wins: the folder given (`view.tokenizer`, `--tokenizer`); the
run's newest checkpoint (every checkpoint folder holds the tokenizer); `model.path` of the run's
`config.yaml`; the locally built `tiny`/`tiny_vl` model its config names (`model.name`, `model.cache_dir`,
`seed`), when that build is present. Without one, pieces are shown as `#<id>`. The tokenizer is loaded on
first use or by `preload` in a background thread (transformers imports take seconds; the run's overview does
not wait for them) and each id is
decoded once (`decode([id])`: a byte-level piece that is part of a multi-byte character shows as U+FFFD).

This module never builds or downloads a model.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def tokenizer_folder(root: Path, config: dict[str, Any], given: str | None = None) -> Path | None:
    """The folder whose tokenizer the viewer uses for the run in `root` (see the module docstring)."""
    if given:
        return Path(given).expanduser()
    checkpoints = sorted((root / "checkpoints").glob("step_*/tokenizer_config.json"),
                         key=lambda p: int(p.parent.name.removeprefix("step_") or 0)
                         if p.parent.name.removeprefix("step_").isdigit() else -1)
    if checkpoints:
        return checkpoints[-1].parent
    model = config.get("model") or {}
    if model.get("path"):
        return Path(model["path"]).expanduser()
    return _built_model(model, int(config.get("seed") or 0))


def _built_model(model: dict[str, Any], seed: int) -> Path | None:
    """The built tiny model's folder when it exists (same cache folder and name as `models/`)."""
    from relax_pipeline.models.spec import BUILT_LOCALLY

    name = model.get("name")
    if name not in BUILT_LOCALLY:
        return None
    default = os.environ.get("RELAX_CACHE_DIR") or Path.home() / ".cache" / "relax_pipeline"
    cache = Path(model.get("cache_dir") or default).expanduser()
    found = sorted(cache.glob(f"{name}-seed{seed}-*/tokenizer_config.json"))
    return found[-1].parent if found else None


class TokenText:
    """Decodes token ids one by one, caching each; falls back to `#<id>` without a tokenizer."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._tokenizer: Any = None
        self._loaded = False
        self._pieces: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        return str(self.folder) if self.folder is not None else "none (token ids shown)"

    def preload(self) -> None:
        """Load the tokenizer in a background thread (once), so the first session opened does not wait for it."""
        if not self._loaded and not self._lock.locked():
            threading.Thread(target=self._load, name="view-tokenizer", daemon=True).start()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        tokenizer = self._load()
        if tokenizer is None:
            return [f"#{i}" for i in ids]
        out = []
        for i in ids:
            piece = self._pieces.get(i)
            if piece is None:
                piece = self._pieces[i] = tokenizer.decode([i])
            out.append(piece)
        return out

    def _load(self) -> Any:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                self._tokenizer = self._open()
            return self._tokenizer

    def _open(self) -> Any:
        if self.folder is None or not (self.folder / "tokenizer_config.json").exists():
            log.warning("no tokenizer found for the run (view.tokenizer=FOLDER sets one): showing token ids")
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder)
