"""ModelSpec: where the policy's weights, tokenizer and chat template come from.

`path` names any local Hugging Face folder; without it the `tiny` model is built locally from `seed`
(no download). This module resolves the folder only; engines and trainers load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """Model choice; connects the `model` config group to engines and trainers."""

    name: str = "tiny"
    path: str | None = None
    cache_dir: str | None = None
    end_of_turn: str | None = None
    seed: int = 0

    def resolve(self) -> Path:
        """The local folder to load, building the tiny model on first use."""
        if self.path is not None:
            folder = Path(self.path).expanduser()
            if not (folder / "config.json").exists():
                raise FileNotFoundError(f"model.path={self.path!r} is not a Hugging Face folder (no config.json)")
            return folder
        if self.name != "tiny":
            raise ValueError(f"model.name={self.name!r} needs model.path; only 'tiny' is built locally")
        from relax_pipeline.models.tiny import build_tiny

        return build_tiny(self.cache_dir, self.seed)
