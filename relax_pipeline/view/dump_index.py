"""An index of one dump file: its sessions (rows grouped by `session_id`) with a summary each and where their
rows sit in the file, so the viewer pages and filters thousands of sessions without holding their tokens.

Building the index reads the file once. Each row is parsed only up to its `messages` field (the dump writes
the small fields first: ids, status, error, timing, branch, reward, advantage, metadata); a row whose head
does not parse that way is parsed whole. A session's full rows are read back by byte offset when it is
opened (`DumpIndex.rows`). Indexes are cached per file and rebuilt when the file's size or mtime changes
(a step's dump is written whole and renamed into place, so a file is never seen half-written).

This module reads dump files only; the session view (`view/session.py`) turns rows into the tree and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

STATUSES = ("completed", "truncated", "aborted", "failed", "dropped", "filtered")
"""Row statuses of docs/design.md §3.4, in the order the viewer lists them."""
HEAD_END = b', "messages": '
HEAD_KEYS = ("session_id", "status", "reward")


@dataclass
class SessionEntry:
    """One session of a dump file: its summary for the list, its rows' places for the session view."""

    session_id: str
    group_id: str
    index: int
    statuses: list[str] = field(default_factory=list)
    """Every row's status, in file order (a forked session has one row per chain)."""
    rewards: list[Any] = field(default_factory=list)
    advantages: list[Any] = field(default_factory=list)
    names: list[Any] = field(default_factory=list)
    branches: list[Any] = field(default_factory=list)
    turns: int = 0
    """The most turns of any of its rows."""
    error: str | None = None
    """The first row error (failed, dropped): the reason."""
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(byte offset, length) of each row in the file."""

    def summary(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "group_id": self.group_id, "index": self.index,
                "status": self.status, "statuses": self.statuses, "rows": len(self.spans),
                "rewards": self.rewards, "advantages": self.advantages, "names": self.names,
                "branches": sum(1 for b in self.branches if b is not None), "turns": self.turns, "error": self.error}

    @property
    def status(self) -> str:
        """The first status in `STATUSES` order that any row has (the session's headline)."""
        return min(self.statuses, key=lambda s: STATUSES.index(s) if s in STATUSES else len(STATUSES))

    def add(self, row: dict[str, Any], span: tuple[int, int]) -> None:
        self.statuses.append(row["status"])
        self.rewards.append(row.get("reward"))
        self.advantages.append(row.get("advantage"))
        self.names.append(row.get("name"))
        self.branches.append(row.get("branch"))
        self.turns = max(self.turns, int(row.get("turn_count") or len((row.get("timing") or {}).get("turns", ()))))
        self.error = self.error or row.get("error")
        self.spans.append(span)


@dataclass
class DumpIndex:
    """Sessions of one dump file in file order, with per-status counts."""

    path: Path
    stamp: tuple[int, float]
    sessions: list[SessionEntry]
    by_id: dict[str, SessionEntry]
    counts: dict[str, int]
    """Sessions having at least one row of each status."""
    rows: int

    @classmethod
    def build(cls, path: Path) -> DumpIndex:
        stat = path.stat()
        data = path.read_bytes()
        by_id: dict[str, SessionEntry] = {}
        start = rows = 0
        while start < len(data):
            end = data.find(b"\n", start)
            end = len(data) if end < 0 else end
            if end > start:
                row = _head(data[start:end])
                entry = by_id.get(row["session_id"])
                if entry is None:
                    entry = by_id[row["session_id"]] = SessionEntry(row["session_id"], row.get("group_id", ""),
                                                                    int(row.get("index") or 0))
                entry.add(row, (start, end - start))
                rows += 1
            start = end + 1
        sessions = list(by_id.values())
        counts = {s: sum(1 for e in sessions if s in e.statuses) for s in STATUSES}
        return cls(path, (stat.st_size, stat.st_mtime), sessions, by_id, counts, rows)

    def page(self, status: str | None, offset: int, limit: int) -> dict[str, Any]:
        """Sessions with a row of `status` (all when None), `limit` of them from `offset`."""
        chosen = self.sessions if not status else [e for e in self.sessions if status in e.statuses]
        return {"total": len(chosen), "offset": offset, "limit": limit, "counts": self.counts,
                "all": len(self.sessions), "rows": self.rows,
                "sessions": [e.summary() for e in chosen[offset: offset + limit]]}

    def read_rows(self, session_id: str) -> list[dict[str, Any]]:
        """The session's full rows, in file order; KeyError when the file has no such session."""
        entry = self.by_id[session_id]
        out = []
        with open(self.path, "rb") as f:
            for offset, length in entry.spans:
                f.seek(offset)
                out.append(orjson.loads(f.read(length)))
        return out


def _head(line: bytes) -> dict[str, Any]:
    """The row's fields before `messages` when they parse on their own and hold the keys the list needs, else
    the whole row."""
    cut = line.find(HEAD_END)
    if cut > 0:
        try:
            head = orjson.loads(line[:cut] + b"}")
            if all(key in head for key in HEAD_KEYS):
                return head
        except orjson.JSONDecodeError:
            pass
    return orjson.loads(line)


class IndexCache:
    """One `DumpIndex` per file, rebuilt when the file changed."""

    def __init__(self) -> None:
        self._indexes: dict[Path, DumpIndex] = {}

    def get(self, path: Path) -> DumpIndex:
        stat = path.stat()
        index = self._indexes.get(path)
        if index is None or index.stamp != (stat.st_size, stat.st_mtime):
            index = self._indexes[path] = DumpIndex.build(path)
        return index
