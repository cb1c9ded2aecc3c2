"""Rollout dump: one JSON line per exported context and per failed or dropped session.

`debug.save_rollout_data` is a path containing `{rollout_id}`; relative paths resolve in the run's
output folder. Each step's rows go to their own file, written whole at the end of the step (a partial
file never looks complete: rows are written to a temporary name, then renamed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class RolloutDump:
    """Writes per-step dump files; a no-op when no path is configured."""

    def __init__(self, pattern: str | None, output_dir: Path) -> None:
        if pattern is not None and "{rollout_id}" not in pattern:
            raise ValueError(f"debug.save_rollout_data={pattern!r} must contain '{{rollout_id}}'")
        self.pattern = pattern
        self.output_dir = output_dir

    def path(self, rollout_id: int) -> Path | None:
        if self.pattern is None:
            return None
        path = Path(self.pattern.format(rollout_id=rollout_id)).expanduser()
        return path if path.is_absolute() else self.output_dir / path

    def write(self, rollout_id: int, rows: Sequence[dict[str, Any]]) -> Path | None:
        path = self.path(rollout_id)
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        return path
