"""Run an agent's shell commands in a sandbox: one session directory writable, no network, bounded resources.

`Sandbox(workdir, limits).run(command)` runs `bash -c command` and returns a `SandboxResult`; `close()`
kills anything of the sandbox still alive. Each run starts `sandbox_init.py` under `unshare` (new mount,
PID, IPC and UTS namespaces, plus a network namespace unless `allow_network`); that script makes the mounts,
sets the limits, drops privileges and execs the command (its docstring has the steps). What the command
gets, by platform (probed once per process by running `unshare ... true`):

- **root** (this CI machine, where `unshare -n true` works): own network namespace with only `lo` (host
  ports unreachable); every mount read-only but the workdir, and the command runs as a uid of its own, so
  writes anywhere else are refused; PID namespace, so whatever the command leaves behind (`&`, `setsid`,
  double forks) is killed when it ends; RLIMIT_NPROC on that uid stops fork bombs.
- **non-root with user namespaces** (`unshare -rn true` works): the same namespaces and read-only mounts;
  the command is uid 0 of the user namespace (the caller's uid outside) with every capability dropped, so
  it cannot undo the mounts; RLIMIT_NPROC is counted per user namespace (kernel >= 5.14), on older kernels
  across all of the caller's processes. Checked on this machine as uid 65534: writes and remounts refused,
  host port refused, CapEff/CapBnd 0, fork bomb bounded, `setsid` leftovers gone. Differences from root:
  no uid of its own (the caller's files outside are protected by the read-only mounts alone), no reveal
  (the caller can reach its own Python), no /etc/passwd entry needed.
- **no namespaces**: `SandboxUnavailable` unless `allow_network=true`; then nothing stops writes outside the
  workdir (as root the command still runs as its own uid), leftovers are killed by process group (a
  `setsid` escape survives), and a fork bomb meets RLIMIT_NPROC (root) and the timeout.

Guarantees common to all: RLIMIT_CPU (`cpu_s`, SIGXCPU), RLIMIT_AS (`memory_mb`), RLIMIT_FSIZE (`file_mb`),
no core files, `PR_SET_NO_NEW_PRIVS`, a wall `timeout` after which the whole tree is killed
(`timed_out=True`, `returncode=124`). Only the last 64 KiB of the merged stdout/stderr are kept.

In root mode each `Sandbox` gets its own uid (a number in /etc/passwd of the sandbox only, named `sandbox`),
so one session's fork bomb does not starve another's and `close()` can find every process by uid. Before
each run the workdir tree is chowned to that uid (symlinks are not followed, hard-linked files are
skipped) and made 0700, so sessions cannot read each other's directories; after the last live run its
files go back to the caller's uid, so the caller reads, edits, deletes them and runs `git` there (git
refuses a repository owned by another uid) as its own. Paths the sandbox uid could not enter (the caller's
Python under /root, a workdir under a 0700 folder) are revealed alone inside a small tmpfs; the rest of
such a folder (other sessions' directories, /root's files) stays hidden.

The command's environment is NOT the caller's (keys stay out): PATH (the caller's), HOME=workdir,
TMPDIR=workdir/.tmp (created; /tmp itself is read-only), USER/LOGNAME=sandbox, LANG=C.UTF-8, then the
`env` given to `run`. Not done here: copying files into the workdir, cgroups (memory is bounded per
process by address space, not for the tree), and killing a run when this Python process itself dies.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from relax_pipeline.agent.sandbox_init import InitPlan

INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
"""Started (by path, `python -I -S`) as the first process inside the namespaces."""
OUTPUT_LIMIT = 64 * 1024
"""Bytes of merged stdout/stderr kept (the last ones)."""
TIMEOUT_RETURNCODE = 124
"""`SandboxResult.returncode` of a command killed by the wall timeout (as coreutils `timeout`)."""
NAMESPACES = ("--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
"""`unshare` flags of every isolated run; `--net` is added unless the network is allowed."""
UID_BASE = 1_100_000_000
"""Root mode: sandbox uids are UID_BASE + (pid % 100000) * 1000 + a counter, far from real accounts."""
_POLL_S = 0.1
"""How often a run with no output is looked at again."""
_GRACE_S = 5.0
"""After the timeout's kill, how long the output pipe may stay open before it is abandoned."""
_uid_counter = itertools.count()


class SandboxUnavailable(RuntimeError):
    """The platform cannot give the isolation asked for; the message names what is missing and the fix."""


@dataclass
class SandboxLimits:
    """Limits of one sandbox: the top-level `sandbox.*` node (sent with every agent.executor=http session and
    applied by the agent server), and what `Sandbox` enforces."""

    allow_network: bool = False
    """False: commands run in their own network namespace (loopback only); True: the host's network."""
    cpu_s: int = 60
    """CPU seconds per process (RLIMIT_CPU); SIGXCPU when spent."""
    memory_mb: int = 2048
    """Address space per process in MiB (RLIMIT_AS)."""
    file_mb: int = 64
    """Largest file a command may write, in MiB (RLIMIT_FSIZE)."""
    max_processes: int = 128
    """Processes and threads of the sandbox user (RLIMIT_NPROC)."""
    timeout: float = 60.0
    """Wall seconds per command; then its whole process tree is killed."""

    def __post_init__(self) -> None:
        if not isinstance(self.allow_network, bool):
            raise ValueError(f"sandbox.allow_network must be true or false, got {self.allow_network!r}")
        for name in ("cpu_s", "memory_mb", "file_mb", "max_processes", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"sandbox.{name} must be a positive number, got {value!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SandboxLimits:
        """Limits from a `sandbox.*` mapping (a config section); an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise ValueError(f"sandbox.{key} is not a sandbox limit; known keys: {', '.join(sorted(known))}")
        return cls(**dict(values))

    def rlimits(self) -> dict[str, list[int]]:
        """`resource` limit name → [soft, hard] for the command's process (CPU: SIGKILL a second after SIGXCPU)."""
        mib = 1 << 20
        return {
            "RLIMIT_CPU": [int(self.cpu_s), int(self.cpu_s) + 1],
            "RLIMIT_AS": [int(self.memory_mb * mib)] * 2,
            "RLIMIT_FSIZE": [int(self.file_mb * mib)] * 2,
            "RLIMIT_NPROC": [int(self.max_processes)] * 2,
            "RLIMIT_CORE": [0, 0],
        }


@dataclass(frozen=True)
class SandboxResult:
    """How one command ended: what `Sandbox.run` returns to the agent server."""

    returncode: int
    """Exit status of `bash -c`; -N when bash itself died of signal N (-24: SIGXCPU); 124 when timed out."""
    output: str
    """stdout and stderr merged, decoded as UTF-8 with replacement; only the last 64 KiB."""
    timed_out: bool
    """True when the wall timeout killed the command (`returncode` is then 124)."""


@dataclass(frozen=True)
class Isolation:
    """What this platform allows, probed once: the mode and the `unshare` flags of a run."""

    mode: str
    """root (namespaces + uid switch), userns (namespaces in a user namespace) or plain (none)."""
    unshare: tuple[str, ...]
    """`unshare` and its flags, `--net` excluded; empty in plain mode."""
    network_reason: str | None
    """None when a network namespace can be made here, else why not."""


def _probe(command: list[str]) -> str | None:
    """None when `command true` succeeds, else what failed."""
    try:
        proc = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`{' '.join(command)} true` could not run: {exc}"
    return None if proc.returncode == 0 else f"`{' '.join(command)} true` failed: {proc.stderr.strip()}"


@functools.cache
def isolation() -> Isolation:
    """Probe `unshare` once per process: as root plain namespaces, otherwise inside a user namespace."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return Isolation("plain", (), "unshare (util-linux) is not on PATH")
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    base = (unshare, *user, *NAMESPACES)
    reason = _probe(list(base))
    if reason is not None:
        return Isolation("plain", (), f"no private mount and PID namespaces here: {reason}")
    return Isolation("root" if not user else "userns", base, _probe([*base, "--net"]))


def network_isolation() -> str | None:
    """None when commands can run in their own network namespace here, else the reason they cannot."""
    return isolation().network_reason


def processes_of(uid: int) -> list[int]:
    """Pids of the live processes whose real uid is `uid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            lines = (entry / "status").read_text().splitlines() if entry.name.isdigit() else []
        except OSError:
            continue
        uids = [line.split()[1] for line in lines if line.startswith("Uid:")]
        if uids and int(uids[0]) == uid:
            found.append(int(entry.name))
    return found


def inside(workdir: Path, cwd: Path | None) -> Path:
    """The absolute working directory for `cwd` (relative to `workdir`); ValueError when it leaves workdir."""
    resolved = (workdir / cwd).resolve() if cwd is not None else workdir
    if resolved != workdir and workdir not in resolved.parents:
        raise ValueError(f"cwd {cwd} is outside the sandbox workdir {workdir}; pass a folder inside it")
    return resolved


def hand_over(workdir: Path, uid: int, gid: int, only_from: int | None = None) -> None:
    """Chown the workdir tree to `uid` without following links, and make the workdir 0700. Only entries owned
    by `only_from` when given; otherwise every entry but hard-linked files (a link to a file elsewhere)."""
    os.chown(workdir, uid, gid)
    os.chmod(workdir, 0o700)
    for folder, dirs, files in os.walk(workdir):
        for name in [*dirs, *files]:
            st = os.lstat(os.path.join(folder, name))
            mine = st.st_uid == only_from if only_from is not None else stat.S_ISDIR(st.st_mode) or st.st_nlink == 1
            if st.st_uid != uid and mine:
                os.lchown(os.path.join(folder, name), uid, gid)


def write_etc(folder: Path, uid: int, gid: int, home: Path) -> None:
    """passwd and group files: the host's plus the `sandbox` user, for lookups by uid inside the sandbox."""
    passwd, group = Path("/etc/passwd"), Path("/etc/group")
    host_passwd = passwd.read_text() if passwd.exists() else ""
    host_group = group.read_text() if group.exists() else ""
    (folder / "passwd").write_text(f"{host_passwd}sandbox:x:{uid}:{gid}:relax sandbox:{home}:/bin/bash\n")
    (folder / "group").write_text(f"{host_group}sandbox:x:{gid}:\n")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's process group (`unshare` and the namespace's init, or everything in plain mode)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def collect(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bool]:
    """Read the output tail until EOF; kill the group at the deadline and once init has ended (leftovers
    outside a PID namespace). (tail, timed out)."""
    assert proc.stdout is not None
    fd, tail, timed_out = proc.stdout.fileno(), bytearray(), False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline + _GRACE_S:
        if not timed_out and time.monotonic() >= deadline:
            timed_out = True
            _kill_group(proc)
        if select.select([fd], [], [], _POLL_S)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            tail += chunk
            del tail[:-OUTPUT_LIMIT]
        elif _exited(proc):
            _kill_group(proc)
    _kill_group(proc)
    proc.wait()
    return bytes(tail), timed_out


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once `unshare`/init has ended; it stays unreaped (WNOWAIT), so its pid still names the group."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def result_of(status: str, output: bytes, timed_out: bool, closed: bool = False) -> SandboxResult:
    """The result from init's status line; killed by `close()`: -9; a set-up failure: `SandboxUnavailable`."""
    text = output.decode("utf-8", "replace")
    kind, _, value = status.strip().partition(" ")
    if kind in ("exit", "signal"):
        return SandboxResult(int(value) if kind == "exit" else -int(value), text, False)
    if timed_out:
        return SandboxResult(TIMEOUT_RETURNCODE, text, True)
    if closed:
        return SandboxResult(-signal.SIGKILL, text, False)
    if kind == "error":
        raise SandboxUnavailable(f"the sandbox could not be set up: {value}")
    raise SandboxUnavailable(f"the sandbox ended without reporting a status; its output: {text[-2000:]}")


def _read_status(fd: int) -> str:
    """The first line the init wrote on the status pipe ('' when none); never blocks."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode("utf-8", "replace").split("\n", 1)[0]


class Sandbox:
    """Runs commands for one session in `workdir` under `limits`; see the module docstring for what holds.

    Invariant: between runs no process of this sandbox is alive (each run's namespace dies with its
    command), so the workdir can be handed over to the sandbox uid without racing the sandbox."""

    def __init__(self, workdir: Path, limits: SandboxLimits) -> None:
        self.limits = limits
        self.isolation = isolation()
        if not limits.allow_network and self.isolation.network_reason is not None:
            raise SandboxUnavailable(
                f"commands cannot be cut off the network here ({self.isolation.network_reason}); "
                "set sandbox.allow_network=true to run code with network access"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir.resolve()
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[bytes]] = set()
        self._closed = False
        switch = os.geteuid() == 0 and self.isolation.mode != "userns"
        self.uid = UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uid_counter) % 1000 if switch else None
        self._etc: Path | None = None
        if self.uid is not None and self.isolation.mode == "root":
            self._etc = Path(tempfile.mkdtemp(prefix="relax-sandbox-"))
            write_etc(self._etc, self.uid, self.uid, self.workdir)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._etc), True) if self._etc else None

    def run(
        self,
        command: str,
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> SandboxResult:
        """Run `bash -c command` in `cwd` (inside the workdir; relative to it) and wait for it to end."""
        if self._closed:
            raise RuntimeError("Sandbox.run() after close(); make a new Sandbox for the session")
        plan_cwd = inside(self.workdir, cwd)
        (self.workdir / ".tmp").mkdir(exist_ok=True)
        read_end, write_end = os.pipe()
        try:
            proc = self._spawn(self._plan(command, plan_cwd, env, write_end), write_end)
        finally:
            os.close(write_end)
        try:
            output, timed_out = collect(proc, self.limits.timeout if timeout is None else timeout)
            return result_of(_read_status(read_end), output, timed_out, self._closed)
        finally:
            os.close(read_end)
            self._restore(proc)

    def close(self) -> None:
        """Kill every process of this sandbox still alive and remove its private files; idempotent.

        The workdir is the caller's and stays."""
        with self._lock:
            self._closed, live = True, list(self._live)
        for proc in live:
            _kill_group(proc)
        if self.uid is not None:
            self._end_strays(self.uid)
        if self._cleanup is not None:
            self._cleanup()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _restore(self, proc: subprocess.Popen[bytes]) -> None:
        """The run is over: when it was the last one live, its files go back to the caller's uid."""
        with self._lock:
            self._live.discard(proc)
            if self.uid is not None and not self._live:
                self._end_strays(self.uid)
                hand_over(self.workdir, os.getuid(), os.getgid(), only_from=self.uid)

    @staticmethod
    def _end_strays(uid: int) -> None:
        """Kill any process of the sandbox uid (none outside a run, but for `setsid` escapes in plain mode),
        so no process races a hand-over walk."""
        for pid in processes_of(uid):
            _kill_pid(pid)

    def _plan(self, command: str, cwd: Path, env: Mapping[str, str] | None, status_fd: int) -> InitPlan:
        """The init script's instructions for one run."""
        isolated = self.isolation.mode != "plain"
        base = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir / ".tmp"),
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "LANG": "C.UTF-8",
        }
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
        return InitPlan(
            command=command,
            cwd=str(cwd),
            workdir=str(self.workdir),
            env={**base, **(env or {})},
            rlimits=self.limits.rlimits(),
            status_fd=status_fd,
            isolate_fs=isolated,
            reveal=sorted(os.path.realpath(p) for p in prefixes) if self.uid is not None and isolated else [],
            etc_dir=str(self._etc) if self._etc is not None else None,
            uid=self.uid,
            gid=self.uid,
            drop_caps=self.isolation.mode == "userns",
            loopback_up=isolated and not self.limits.allow_network,
        )

    def _spawn(self, plan: InitPlan, status_fd: int) -> subprocess.Popen[bytes]:
        """Start init (under unshare), hand it the plan on stdin, and register the run as live. With a sandbox
        uid and no run live, its strays are ended and the workdir is handed over to it first."""
        net = ("--net",) if plan.loopback_up else ()
        argv = [*self.isolation.unshare, *net, sys.executable, "-I", "-S", str(INIT_SCRIPT)]
        with self._lock:
            if self.uid is not None and not self._live:
                self._end_strays(self.uid)
                hand_over(self.workdir, self.uid, self.uid)
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(status_fd,),
                start_new_session=True,
                cwd="/",
                env={"PATH": os.environ.get("PATH", os.defpath)},
            )
            self._live.add(proc)
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(asdict(plan)).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return proc


def _kill_pid(pid: int) -> None:
    """SIGKILL one process; gone already is fine."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
