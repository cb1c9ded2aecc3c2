"""The sandbox against real escapes: each test runs real commands and checks they were refused or cleaned up.

Network (a port the test listens on at 127.0.0.1), writes outside the session directory, a fork bomb,
processes left running (`&`, `setsid`, double fork), CPU, address-space and file-size limits, the wall
timeout, and `close()` during a run. Leftovers are found by a unique marker in their command line, so the
checks hold in every isolation mode. The user-namespace mode (what non-root hosts get) is run here too,
forced on this root machine, for the escapes it must stop by mounts alone.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import relax_pipeline
from relax_pipeline.agent import sandbox as sandbox_module
from relax_pipeline.agent.sandbox import (
    NAMESPACES,
    OUTPUT_LIMIT,
    TIMEOUT_RETURNCODE,
    Isolation,
    Sandbox,
    SandboxLimits,
    isolation,
    network_isolation,
    processes_of,
)

PY = sys.executable
REASON = network_isolation()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"this platform cannot isolate commands: {REASON}")
MakeSandbox = Callable[..., Sandbox]


@pytest.fixture
def make_sandbox(tmp_path: Path) -> Iterator[MakeSandbox]:
    """Sandboxes on `tmp_path/session` (under pytest's 0700 folder: the reveal path is exercised); closed after."""
    made: list[Sandbox] = []

    def make(**limits: object) -> Sandbox:
        box = Sandbox(tmp_path / "session", SandboxLimits(**{"timeout": 30.0, **limits}))  # type: ignore[arg-type]
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


def alive_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


def connect_snippet(port: int) -> str:
    """A command that tries the host port and prints what happened."""
    code = (
        f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=5)\n print('CONNECTED')\n"
        "except OSError as e:\n print('FAILED', type(e).__name__, e)\n raise SystemExit(3)"
    )
    return f"{PY} -c {shlex.quote(code)}"


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP server of the host on 127.0.0.1 (connections complete through the backlog)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)
    yield server
    server.close()


def test_host_port_is_unreachable_without_network(make_sandbox: MakeSandbox, listener: socket.socket) -> None:
    result = make_sandbox().run(connect_snippet(listener.getsockname()[1]))
    assert result.returncode == 3 and "FAILED" in result.output, result.output


def test_host_port_is_reachable_with_network_allowed(make_sandbox: MakeSandbox, listener: socket.socket) -> None:
    result = make_sandbox(allow_network=True).run(connect_snippet(listener.getsockname()[1]))
    assert result.returncode == 0 and "CONNECTED" in result.output, result.output
    listener.accept()[0].close()


def test_loopback_works_inside(make_sandbox: MakeSandbox) -> None:
    code = "import socket\ns = socket.create_server(('127.0.0.1', 0))\n"
    code += "socket.create_connection(s.getsockname())\nprint('LO OK')"
    result = make_sandbox().run(f"{PY} -c {shlex.quote(code)}")
    assert result.returncode == 0 and "LO OK" in result.output, result.output


def outside_targets(workdir: Path) -> list[Path]:
    """Places a command must not write to."""
    repo = Path(relax_pipeline.__file__).resolve().parents[1]
    return [Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), workdir.parent, Path.home(), repo, Path(PY).parent]


def test_writes_outside_the_workdir_are_refused(make_sandbox: MakeSandbox) -> None:
    box = make_sandbox()
    name = f"escape-{uuid.uuid4().hex}"
    targets = [t for t in outside_targets(box.workdir) if t.is_dir()]
    command = "; ".join(f"echo x > {t / name} && echo WROTE {t}" for t in targets)
    result = box.run(f"{command}; mkdir -p deep/er && echo inside > deep/er/{name} && echo INSIDE")
    assert "WROTE" not in result.output and "INSIDE" in result.output, result.output
    assert not [t for t in targets if (t / name).exists()]
    assert (box.workdir / "deep" / "er" / name).read_text() == "inside\n"


def test_mounts_cannot_be_undone(make_sandbox: MakeSandbox) -> None:
    result = make_sandbox().run("mount -o remount,bind,rw /tmp; umount /tmp; touch /tmp/undo-$$ && echo UNDONE")
    assert "UNDONE" not in result.output, result.output


def test_caller_files_are_usable_inside_and_results_readable_after(make_sandbox: MakeSandbox) -> None:
    box = make_sandbox()
    box.workdir.joinpath("repo").mkdir(exist_ok=True)
    box.workdir.joinpath("repo", "given.txt").write_text("from the caller\n")
    result = box.run("cat given.txt && echo more >> given.txt && echo made > made.txt; id -u", cwd=Path("repo"))
    assert result.returncode == 0 and "from the caller" in result.output, result.output
    assert (box.workdir / "repo" / "given.txt").read_text() == "from the caller\nmore\n"
    assert (box.workdir / "repo" / "made.txt").read_text() == "made\n"
    assert result.output.endswith(f"{box.uid if box.uid is not None else 0}\n")
    owners = {p.stat().st_uid for p in [box.workdir, *box.workdir.rglob("*")]}
    assert owners == {os.getuid()}


def test_environment_is_the_given_one_not_the_callers(
    make_sandbox: MakeSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CALLER_SECRET", "hunter2")
    box = make_sandbox()
    result = box.run('echo "[$CALLER_SECRET] [$GIVEN] $HOME $TMPDIR"; pwd', env={"GIVEN": "yes"})
    assert f"[] [yes] {box.workdir} {box.workdir / '.tmp'}\n{box.workdir}\n" == result.output


def test_cwd_outside_the_workdir_is_refused(make_sandbox: MakeSandbox) -> None:
    with pytest.raises(ValueError, match="outside the sandbox workdir"):
        make_sandbox().run("true", cwd=Path(".."))


def test_fork_bomb_is_bounded_and_nothing_survives(make_sandbox: MakeSandbox) -> None:
    marker = f"bomb{uuid.uuid4().hex}"
    box = make_sandbox(max_processes=48)
    result = box.run(f"bash -c ':(){{ :|:& }};:; sleep 1000' {marker}", timeout=3)
    assert result.timed_out and result.returncode == TIMEOUT_RETURNCODE
    assert "Resource temporarily unavailable" in result.output, result.output[-2000:]
    assert alive_with(marker) == []
    assert box.uid is None or processes_of(box.uid) == []


@pytest.mark.parametrize(
    "start",
    ["sleep {m} &", "setsid sleep {m} &", "( (sleep {m} &) & )", "nohup sleep {m} >/dev/null 2>&1 &"],
    ids=["background", "setsid", "double-fork", "nohup"],
)
def test_processes_left_running_are_killed(make_sandbox: MakeSandbox, start: str) -> None:
    marker = f"1000.{uuid.uuid4().int % 10**9}"
    command = (
        start.format(m=marker)
        + f"\nfor i in $(seq 50); do pgrep -f '^sleep {marker}' >/dev/null && break; sleep 0.1; done"
    )
    result = make_sandbox().run(f"{command}; pgrep -f '^sleep {marker}' >/dev/null && echo RUNNING")
    assert result.returncode == 0 and "RUNNING" in result.output, result.output
    assert alive_with(marker) == []


def test_cpu_seconds_limit_sends_sigxcpu(make_sandbox: MakeSandbox) -> None:
    result = make_sandbox(cpu_s=1).run("while :; do :; done", timeout=120)
    assert not result.timed_out and result.returncode == -signal.SIGXCPU


def test_file_size_limit(make_sandbox: MakeSandbox) -> None:
    code = "open('big', 'wb').write(b'0' * 3_000_000)"
    box = make_sandbox(file_mb=1)
    result = box.run(f"{PY} -c {shlex.quote(code)}")
    assert result.returncode != 0 and "File too large" in result.output, result.output
    assert (box.workdir / "big").stat().st_size <= 1 << 20


def test_memory_limit(make_sandbox: MakeSandbox) -> None:
    small, large = "bytearray(16 << 20); print('SMALL OK')", "bytearray(512 << 20); print('LARGE OK')"
    box = make_sandbox(memory_mb=256)
    assert "SMALL OK" in box.run(f"{PY} -c {shlex.quote(small)}").output
    result = box.run(f"{PY} -c {shlex.quote(large)}")
    assert result.returncode == 1 and "MemoryError" in result.output, result.output


def test_wall_timeout_kills_the_tree_and_keeps_output(make_sandbox: MakeSandbox) -> None:
    marker = f"2000.{uuid.uuid4().int % 10**9}"
    result = make_sandbox().run(f"echo before; sleep {marker} & sleep {marker}", timeout=0.5)
    assert result.timed_out and result.returncode == TIMEOUT_RETURNCODE and result.output == "before\n"
    assert alive_with(marker) == []


def test_output_keeps_the_tail(make_sandbox: MakeSandbox) -> None:
    result = make_sandbox().run("head -c 200000 /dev/zero | tr '\\0' a; echo END")
    assert len(result.output) == OUTPUT_LIMIT and result.output.endswith("aaaEND\n")


def test_signal_death_is_a_negative_returncode(make_sandbox: MakeSandbox) -> None:
    box = make_sandbox()
    assert box.run("exit 7").returncode == 7
    assert box.run("kill -TERM $$").returncode == -signal.SIGTERM


def test_close_kills_a_running_command(make_sandbox: MakeSandbox) -> None:
    marker = f"3000.{uuid.uuid4().int % 10**9}"
    box = make_sandbox()
    results = []
    thread = threading.Thread(target=lambda: results.append(box.run(f"sleep {marker}")))
    thread.start()
    for _ in range(300):
        if alive_with(f"sleep\0{marker}"):
            break
        threading.Event().wait(0.05)
    box.close()
    box.close()
    thread.join(30)
    assert results and results[0].returncode == -signal.SIGKILL and not results[0].timed_out
    assert alive_with(marker) == []
    with pytest.raises(RuntimeError, match="after close"):
        box.run("true")


@pytest.fixture
def userns_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the mode non-root hosts get: namespaces inside a user namespace, no uid switch."""
    if isolation().mode == "plain":
        pytest.skip("no namespaces on this platform")
    base = (shutil.which("unshare") or "unshare", "--user", "--map-root-user", *NAMESPACES)
    reason = sandbox_module._probe([*base, "--net"])
    if reason is not None:
        pytest.skip(f"no user namespaces here: {reason}")
    monkeypatch.setattr(sandbox_module, "isolation", lambda: Isolation("userns", base, None))


def test_user_namespace_mode_refuses_the_same_escapes(
    userns_mode: None, make_sandbox: MakeSandbox, listener: socket.socket
) -> None:
    box = make_sandbox()
    assert box.uid is None
    name = f"escape-{uuid.uuid4().hex}"
    targets = [t for t in outside_targets(box.workdir) if t.is_dir()]
    writes = "; ".join(f"echo x > {t / name} && echo WROTE {t}" for t in targets)
    undo = "mount -o remount,bind,rw /tmp; umount /tmp"
    marker = f"4000.{uuid.uuid4().int % 10**9}"
    result = box.run(
        f"{undo}; {writes}; setsid sleep {marker} & echo ok > {name}; " + connect_snippet(listener.getsockname()[1])
    )
    assert "WROTE" not in result.output and "FAILED" in result.output, result.output
    assert not [t for t in targets if (t / name).exists()] and (box.workdir / name).read_text() == "ok\n"
    assert alive_with(marker) == []


def test_sessions_cannot_read_each_other(make_sandbox: MakeSandbox, tmp_path: Path) -> None:
    mine = make_sandbox()
    other = Sandbox(tmp_path / "other", SandboxLimits(timeout=30.0))
    try:
        assert other.run("echo secret > notes.txt").returncode == 0
        result = mine.run(f"cat {other.workdir / 'notes.txt'} && echo READ")
        assert "READ" not in result.output and "secret" not in result.output, result.output
    finally:
        other.close()
