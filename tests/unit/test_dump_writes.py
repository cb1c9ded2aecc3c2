"""The rollout dump appends whole lines or nothing: a full disk leaves the file as it was, and a line cut
by a killed writer is removed before the next append."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from relax_pipeline.tracking import dump as dump_module
from relax_pipeline.tracking.dump import DumpWriteError, RolloutDump

ROWS = [{"rollout_id": 0, "status": "completed", "text": "é" * 50}, {"rollout_id": 0, "status": "failed"}]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_second_write_of_a_step_appends(tmp_path: Path) -> None:
    dump = RolloutDump("r_{rollout_id}.jsonl", tmp_path)
    dump.write(0, ROWS[:1])
    path = dump.write(0, ROWS[1:])
    assert path == tmp_path / "r_0.jsonl" and lines(path) == ROWS


def test_a_full_disk_leaves_the_file_unchanged_and_names_the_fix(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dump = RolloutDump("r_{rollout_id}.jsonl", tmp_path)
    before = dump.write(0, ROWS[:1]).read_bytes()
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        real_write(fd, data[:7])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dump_module.os, "write", full)
    with pytest.raises(DumpWriteError, match="No space left on device.*unchanged.*debug.save_rollout_data=null"):
        dump.write(0, ROWS)
    assert (tmp_path / "r_0.jsonl").read_bytes() == before


def test_a_short_write_is_an_error_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write
    monkeypatch.setattr(dump_module.os, "write", lambda fd, data: real_write(fd, data[:3]))
    with pytest.raises(DumpWriteError, match="short write: 3 of"):
        RolloutDump("r_{rollout_id}.jsonl", tmp_path).write(0, ROWS)
    assert (tmp_path / "r_0.jsonl").read_bytes() == b""


def test_a_line_cut_by_a_killed_writer_is_removed_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "r_3.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"rollout_id": 3, "sta')
    RolloutDump("r_{rollout_id}.jsonl", tmp_path).write(3, ROWS[1:])
    assert lines(path) == ROWS
    path.write_text('{"cut')
    RolloutDump("r_{rollout_id}.jsonl", tmp_path).write(3, ROWS[:1])
    assert lines(path) == ROWS[:1]
