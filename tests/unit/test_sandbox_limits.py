"""The sandbox's pure parts, without running anything: limits from config, results from init's status line,
working-directory checks, mountinfo parsing, the workdir hand-over, and the refusal without a network
namespace (the probe replaced by a fixed answer)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_pipeline.agent import sandbox as sandbox_module
from relax_pipeline.agent.sandbox import (
    TIMEOUT_RETURNCODE,
    Isolation,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    hand_over,
    inside,
    result_of,
    write_etc,
)
from relax_pipeline.agent.sandbox_init import InitPlan, closed_ancestor, is_within, parse_mountinfo_line
from relax_pipeline.config import Config


def test_the_sandbox_node_is_the_limits_record() -> None:
    assert {f.name: f.type for f in dataclasses.fields(Config)}["sandbox"] == "SandboxLimits"


def test_from_mapping_reads_every_key() -> None:
    values = {"allow_network": True, "cpu_s": 5, "memory_mb": 300, "file_mb": 2, "max_processes": 9, "timeout": 1.5}
    assert dataclasses.asdict(SandboxLimits.from_mapping(values)) == values


def test_from_mapping_names_an_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"sandbox\.cpu_seconds is not a sandbox limit; known keys: allow_network"):
        SandboxLimits.from_mapping({"cpu_seconds": 5})


@pytest.mark.parametrize(
    ("key", "value"), [("cpu_s", 0), ("memory_mb", -1), ("timeout", "60"), ("max_processes", True), ("file_mb", None)]
)
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"sandbox\.{key} must be a positive number"):
        SandboxLimits.from_mapping({key: value})


def test_allow_network_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"sandbox\.allow_network must be true or false"):
        SandboxLimits(allow_network="no")  # type: ignore[arg-type]


def test_rlimits() -> None:
    limits = SandboxLimits(cpu_s=3, memory_mb=100, file_mb=2, max_processes=7).rlimits()
    assert limits == {
        "RLIMIT_CPU": [3, 4],
        "RLIMIT_AS": [100 << 20, 100 << 20],
        "RLIMIT_FSIZE": [2 << 20, 2 << 20],
        "RLIMIT_NPROC": [7, 7],
        "RLIMIT_CORE": [0, 0],
    }


@pytest.mark.parametrize(
    ("status", "timed_out", "closed", "expected"),
    [
        ("exit 3\n", False, False, SandboxResult(3, "out", False)),
        ("signal 24\n", False, False, SandboxResult(-signal.SIGXCPU, "out", False)),
        ("exit 0\n", True, False, SandboxResult(0, "out", False)),
        ("", True, False, SandboxResult(TIMEOUT_RETURNCODE, "out", True)),
        ("", False, True, SandboxResult(-signal.SIGKILL, "out", False)),
    ],
)
def test_result_of_status(status: str, timed_out: bool, closed: bool, expected: SandboxResult) -> None:
    assert result_of(status, b"out", timed_out, closed) == expected


def test_result_decodes_with_replacement() -> None:
    assert result_of("exit 0", b"a\xffb", False).output == "a\ufffdb"


def test_setup_failure_and_silence_are_unavailable() -> None:
    with pytest.raises(SandboxUnavailable, match="could not be set up: mount /x: Permission denied"):
        result_of("error mount /x: Permission denied\n", b"", False)
    with pytest.raises(SandboxUnavailable, match="without reporting a status; its output: Traceback"):
        result_of("", b"Traceback ...", False)


def test_cwd_must_stay_inside_the_workdir(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "link").symlink_to(tmp_path.parent)
    assert inside(tmp_path, None) == tmp_path
    assert inside(tmp_path, Path("sub")) == tmp_path / "sub"
    assert inside(tmp_path, tmp_path / "sub") == tmp_path / "sub"
    for outside in (Path(".."), Path("/etc"), Path("link")):
        with pytest.raises(ValueError, match="outside the sandbox workdir"):
            inside(tmp_path, outside)


def test_mountinfo_line_with_escaped_space() -> None:
    line = r"36 35 98:0 /mnt1 /mnt/my\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue"
    assert parse_mountinfo_line(line) == ("/mnt/my dir", "ext3")
    assert parse_mountinfo_line("22 27 0:21 / /proc rw,relatime - proc proc rw") == ("/proc", "proc")


def test_is_within() -> None:
    assert is_within("/a/b", "/a") and is_within("/a", "/a") and is_within("/a/b", "/")
    assert not is_within("/ab", "/a") and not is_within("/", "/a")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder others may enter, outside pytest's own 0700 folder."""
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_closed_ancestor_is_the_highest_one_others_cannot_enter(open_dir: Path) -> None:
    if closed_ancestor(str(open_dir / "x")) is not None:
        pytest.skip(f"an ancestor of {open_dir} is already closed to others")
    deep = open_dir / "open" / "shut" / "also_shut" / "target"
    deep.mkdir(parents=True, mode=0o755)
    (open_dir / "open" / "shut").chmod(0o700)
    (open_dir / "open" / "shut" / "also_shut").chmod(0o700)
    assert closed_ancestor(str(deep)) == str(open_dir / "open" / "shut")
    assert closed_ancestor(str(open_dir / "open" / "other")) is None


def test_init_plan_round_trips_as_json() -> None:
    plan = InitPlan(command="true", cwd="/w", workdir="/w", env={"A": "1"}, rlimits={"RLIMIT_CPU": [1, 2]}, status_fd=5)
    assert InitPlan(**json.loads(json.dumps(dataclasses.asdict(plan)))) == plan


def test_etc_files_name_the_sandbox_user(tmp_path: Path) -> None:
    write_etc(tmp_path, 1234, 1234, Path("/w"))
    assert (tmp_path / "passwd").read_text().endswith("sandbox:x:1234:1234:relax sandbox:/w:/bin/bash\n")
    assert (tmp_path / "group").read_text().endswith("sandbox:x:1234:\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_hand_over_follows_no_link_and_skips_hard_links(tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "sub").mkdir(parents=True)
    outside.write_text("x")
    (work / "sub" / "file").write_text("y")
    (work / "link").symlink_to(outside)
    os.link(outside, work / "hard")
    hand_over(work, 4321, 4321)
    owners = {p.name: p.lstat().st_uid for p in [work, work / "sub", work / "sub" / "file", work / "link"]}
    assert owners == {"work": 4321, "sub": 4321, "file": 4321, "link": 4321}
    assert outside.stat().st_uid == 0 and (work / "hard").stat().st_uid == 0
    assert work.stat().st_mode & 0o777 == 0o700
    os.chown(work / "sub", 999, 999)
    hand_over(work, 0, 0, only_from=4321)
    owners = {p.name: p.lstat().st_uid for p in [work, work / "sub", work / "sub" / "file", work / "link"]}
    assert owners == {"work": 0, "sub": 999, "file": 0, "link": 0}


def test_no_network_namespace_is_refused_unless_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_module, "isolation", lambda: Isolation("plain", (), "unshare is not on PATH"))
    with pytest.raises(SandboxUnavailable, match=r"\(unshare is not on PATH\); set sandbox.allow_network=true"):
        Sandbox(tmp_path / "w", SandboxLimits())
    Sandbox(tmp_path / "w", SandboxLimits(allow_network=True)).close()
