"""A run's output folder as the viewer reads it: its config, its dump files, its metrics and its fork records.

`RunFolder` finds what a run wrote (docs/design.md §3.1, §3.4): `config.yaml` (for the dump pattern and the model),
the rollout dump files (`debug.save_rollout_data` with `{rollout_id}` → the step number, or
`eval_<name>_<steps done>` for eval dumps), `metrics.jsonl` (`tracking/metrics_file.py`) or, for runs
that predate it, the `step N metrics k=v ...` and `eval after N steps metrics ...` lines of `run.log`,
and the fork records `session S turn N forked: why` of `run.log`. Everything is re-read when its file
changed (size or mtime), so a refresh shows a running run's new steps; `run.log` is read incrementally
from where the last read stopped. Without a `config.yaml` (or without a dump pattern in it) the dump
files are found as `*.jsonl` files under the folder (two levels) whose first row has a `rollout_id`. A replay
bundle folder (`bundle.json`, `view/bundle.py`) is read as a one-step run: its `rows.jsonl` is the step's dump
and its `metrics.json` the step's metrics.

This module never writes into the folder and parses no dump row beyond the first of a file (that is
`view/dump_index.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relax_pipeline.tracking.metrics_file import METRICS_FILE, read_metrics_file
from relax_pipeline.view.bundle import BundleFolder, is_bundle

STEP_LINE = re.compile(r" step (\d+) metrics (.*)$")
EVAL_LINE = re.compile(r" eval after (\d+) steps metrics (.*)$")
FORK_LINE = re.compile(r" session (\S+) turn (\d+) forked: (.*)$")
FORK_MESSAGE = re.compile(r"message (\d+) differs")
SKIP_DIRS = ("sessions", "checkpoints", "wandb")


@dataclass(frozen=True)
class DumpFile:
    """One dump file of the run; connects the folder scan to the dump index and the step list."""

    id: str
    """The `{rollout_id}` part of its name: the step number, or `eval_<name>_<steps done>`."""
    path: Path
    kind: str
    """`train` (a rollout step) or `eval`."""

    @property
    def order(self) -> tuple[int, int, str]:
        """Sort key: train steps by number, then eval dumps by steps done."""
        if self.id.isdigit():
            return (0, int(self.id), "")
        tail = self.id.rsplit("_", 1)[-1]
        return (1, int(tail) if tail.isdigit() else 0, self.id)


@dataclass(frozen=True)
class ForkRecord:
    """A fork logged by the turn service: where a session's request left its committed history and why."""

    session_id: str
    turn: int
    """The session's turn count when the forked request was answered."""
    why: str
    """The log's description (`re-sent assistant message 1 differs in content; new branch below node 1`)."""
    message_index: int | None
    """Index of the first differing message, when the description names one."""


class LogReader:
    """`run.log` read incrementally: step metrics, eval metrics and fork records, in file order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reset()

    def _reset(self) -> None:
        self._offset = 0
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.forks: dict[str, list[ForkRecord]] = {}
        self.last_line = ""

    def refresh(self) -> None:
        """Read the lines added since the last call (a shorter file was rewritten: read it again)."""
        if not self.path.exists():
            return
        size = self.path.stat().st_size
        if size < self._offset:
            self._reset()
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            self._read(line)

    def _read(self, line: str) -> None:
        if line.strip():
            self.last_line = line
        if " forked: " in line and (match := FORK_LINE.search(line)):
            index = FORK_MESSAGE.search(match.group(3))
            record = ForkRecord(match.group(1), int(match.group(2)), match.group(3),
                                int(index.group(1)) if index else None)
            self.forks.setdefault(record.session_id, []).append(record)
        elif " metrics " in line and (match := STEP_LINE.search(line) or EVAL_LINE.search(line)):
            self.steps.append((int(match.group(1)), parse_pairs(match.group(2))))


def parse_pairs(text: str) -> dict[str, float]:
    """`k=v k=v ...` of a metrics log line; values that are not numbers are skipped."""
    out = {}
    for pair in text.split():
        key, _, value = pair.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


class RunFolder:
    """Read-only access to one run's output folder (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"view.dir={str(root)!r} is not a folder; give a run's output folder")
        self.log = LogReader(self.root / "run.log")
        self._config: tuple[float, dict[str, Any]] | None = None
        self.bundle = BundleFolder(self.root) if is_bundle(self.root) else None
        """The replay bundle when the folder is one (`view/bundle.py`), else None."""

    def certificate(self) -> dict[str, Any] | None:
        """`check/certificate.json` as written by `job=check` (its schema: `relax_pipeline/certify/certificate.py`);
        None when the folder has none or it is not JSON yet (being written)."""
        path = self.root / "check" / "certificate.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def config(self) -> dict[str, Any]:
        """The run's composed config (`config.yaml`), {} when there is none."""
        path = self.root / "config.yaml"
        if not path.exists():
            return {}
        stamp = path.stat().st_mtime
        if self._config is None or self._config[0] != stamp:
            self._config = (stamp, yaml.safe_load(path.read_text(encoding="utf-8")) or {})
        return self._config[1]

    def dump_files(self) -> list[DumpFile]:
        """Every dump file, train steps first (by step), then eval dumps (by steps done)."""
        if self.bundle is not None:
            rows = self.bundle.rows_path
            return [DumpFile(str(self.bundle.step), rows, "train")] if rows.is_file() else []
        pattern = (self.config().get("debug") or {}).get("save_rollout_data")
        found = self._by_pattern(pattern) if pattern else self._by_scan()
        return sorted(found, key=lambda d: d.order)

    def _by_pattern(self, pattern: str) -> list[DumpFile]:
        path = Path(pattern).expanduser()
        path = path if path.is_absolute() else self.root / path
        head, _, tail = path.name.partition("{rollout_id}")
        name = re.compile(re.escape(head) + r"(.+?)" + re.escape(tail) + "$")
        files = path.parent.glob(head + "*" + tail) if path.parent.is_dir() else []
        return [_dump_file(m.group(1), p) for p in files if (m := name.match(p.name))]

    def _by_scan(self) -> list[DumpFile]:
        found = []
        for path in [*self.root.glob("*.jsonl"), *self.root.glob("*/*.jsonl")]:
            if path.name == METRICS_FILE or path.parent.name in SKIP_DIRS or not _is_dump(path):
                continue
            with open(path, encoding="utf-8") as f:
                rollout_id = json.loads(f.readline())["rollout_id"]
            found.append(_dump_file(str(rollout_id), path))
        return found

    def metrics(self) -> tuple[str, dict[str, list[tuple[int, float]]]]:
        """(source file name, metric name → (step, value) points in step order)."""
        if self.bundle is not None:
            return "metrics.json", self.bundle.curves()
        self.log.refresh()
        path = self.root / METRICS_FILE
        source, records = (METRICS_FILE, read_metrics_file(path)) if path.exists() else ("run.log", self.log.steps)
        curves: dict[str, dict[int, float]] = {}
        for step, values in records:
            for key, value in values.items():
                curves.setdefault(key, {})[step] = value
        return source, {key: sorted(points.items()) for key, points in curves.items()}

    def trained_version(self, step: str) -> int | None:
        """The weight version step `step` trained (`train/weight_version` is logged after the bump, so one less);
        the step number when the metric is absent; None for an eval dump (nothing trained on it)."""
        if not step.isdigit():
            return None
        logged = dict(self.metrics()[1].get("train/weight_version", ()))
        return int(logged[int(step)]) - 1 if int(step) in logged else int(step)

    def forks(self, session_id: str) -> list[ForkRecord]:
        self.log.refresh()
        return list(self.log.forks.get(session_id, ()))


def _dump_file(rollout_id: str, path: Path) -> DumpFile:
    return DumpFile(rollout_id, path, "train" if rollout_id.isdigit() else "eval")


def _is_dump(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline() or "null")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and "rollout_id" in first and "session_id" in first
