"""Rollout dump: one JSON line per exported context and per failed or dropped session.

`debug.save_rollout_data` is a path containing `{rollout_id}`; relative paths resolve in the run's
output folder. Each step's rows go to their own file, written at the end of the step and appended when
the file exists already (a step interrupted by SIGINT writes its dropped rows, and the resumed run appends
the rows of its second try: nothing is overwritten).

No half-written line, ever: the rows are encoded first and written with one `os.write` on an `O_APPEND`
descriptor; if the write fails or is short (a full disk: ENOSPC, a quota), the file is cut back to its
size before the write and `DumpWriteError` names the file, the cause and the fix. A file whose last line
was cut by a process killed mid-write (`kill -9`) is repaired before the next append: the partial line
is dropped (and logged), so every line in the file parses.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DumpWriteError(OSError):
    """The dump could not be written whole; the file holds exactly what it held before."""


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
        """Append `rows` to the step's file, all or nothing."""
        path = self.path(rollout_id)
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = _repair(fd, path)
            _append(fd, path, payload, size)
        finally:
            os.close(fd)
        return path


def _repair(fd: int, path: Path) -> int:
    """Cut a trailing partial line (left by a killed writer); returns the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    tail = os.pread(fd, min(size, 1 << 20), max(0, size - (1 << 20)))
    keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
    os.ftruncate(fd, keep)
    log.warning("%s ended with a partial line (%d bytes, a writer killed mid-line); removed it", path, size - keep)
    return keep


def _append(fd: int, path: Path, payload: bytes, size: int) -> None:
    """One write of the whole payload; on failure the file is cut back to `size`."""
    try:
        written = os.write(fd, payload)
        if written != len(payload):
            raise OSError(f"short write: {written} of {len(payload)} bytes")
        os.fsync(fd)
    except OSError as error:
        os.ftruncate(fd, size)
        raise DumpWriteError(f"could not write the rollout dump {path} ({error}); the file is unchanged. Free "
                             "disk space (or set debug.save_rollout_data=null to run without a dump)") from error
