"""The first process inside a sandbox's namespaces: sets the sandbox up, runs the command, reports how it ended.

`relax_pipeline.agent.sandbox` starts this file as a script (`python -I -S sandbox_init.py`, under
`unshare` where the platform has namespaces) and writes an `InitPlan` as JSON to its stdin. The script
then, in this order:

1. points its stdin at /dev/null and brings the loopback interface up (in a new network namespace);
2. with `isolate_fs`: makes the session directory a writable bind mount of itself, reveals paths the
   sandbox user could not reach (a directory others may not enter, such as /root holding the Python of
   the caller, is covered by a small tmpfs in which only the needed paths are bind-mounted), binds the
   plan's passwd/group files over /etc, and remounts every other mount read-only (pseudo file systems
   such as /proc and /sys excepted; their files obey permissions alone);
3. forks the command (staying in the caller's process group): resource limits, then either a switch to the
   sandbox uid (root mode: `setgroups([])`, `setgid`, `setuid`) or, in a user namespace, the loss of every capability
   (`SECBIT_NOROOT`, bounding set emptied); `PR_SET_NO_NEW_PRIVS` in both, so set-uid programs gain
   nothing; then `execve("/bin/bash", ["bash", "-c", command])`;
4. waits, reaping every orphan (it is PID 1 of a PID namespace), and writes one status line to
   `status_fd`: `exit N`, `signal N`, or `error MESSAGE` when the set-up failed. When it exits, the
   kernel kills whatever the command left behind in the namespace.

Not done here: choosing uids, probing what the platform allows, timeouts and output capture (all in
`sandbox`). Only the standard library is used: the script runs with `-I -S`, outside the package.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import socket
import stat
import struct
import sys
from dataclasses import dataclass, field

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
KEPT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096
"""Per-mount flags a read-only remount keeps (nosuid, nodev, noexec, noatime, nodiratime, relatime): a user
namespace may not drop them; `statvfs` reports them with the same bit values."""
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 24, 28, 38
SECUREBITS_NO_ROOT = 0x2F
"""SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP and their locks, SECBIT_KEEP_CAPS_LOCKED: uid 0 gains no capability
on exec."""
PSEUDO_FS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "securityfs",
        "debugfs",
        "tracefs",
        "bpf",
        "fusectl",
        "configfs",
        "pstore",
        "binfmt_misc",
        "autofs",
        "efivarfs",
        "nsfs",
        "selinuxfs",
    }
)
"""File systems left as they are: writes there are governed by permissions (root-only), not by location."""
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


@dataclass(frozen=True)
class InitPlan:
    """What `sandbox.Sandbox.run` asks of this script; sent as JSON on stdin."""

    command: str
    """Run by `bash -c`."""
    cwd: str
    """Absolute working directory of the command, inside `workdir`."""
    workdir: str
    """Absolute, resolved session directory: the one writable place."""
    env: dict[str, str]
    """The command's whole environment."""
    rlimits: dict[str, list[int]]
    """`resource` limit name (RLIMIT_CPU, ...) → [soft, hard], set in the command's process."""
    status_fd: int
    """Inherited pipe end that receives the one status line."""
    isolate_fs: bool = False
    """Set up the mounts (needs a private mount namespace)."""
    reveal: list[str] = field(default_factory=list)
    """Absolute paths the command must reach (the Python prefixes) even where an ancestor is closed to it."""
    etc_dir: str | None = None
    """Folder holding `passwd` and `group` to bind over /etc (names the sandbox uid), or None."""
    uid: int | None = None
    """Switch to this uid/gid before exec (root mode), or None."""
    gid: int | None = None
    """Group of `uid`."""
    drop_caps: bool = False
    """Lose every capability before exec (user-namespace mode, where there is no other uid to switch to)."""
    loopback_up: bool = False
    """Bring `lo` up (the command runs in a new network namespace)."""


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    """Raise OSError naming `what` when a libc call failed."""
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2)."""
    args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]), f"mount {target}")


def remount_read_only(target: str) -> None:
    """Make one mount read-only, keeping the flags a user namespace may not drop."""
    kept = os.statvfs(target).f_flag & KEPT_FLAGS
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def mount_points() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount, in /proc/self/mountinfo order."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [parse_mountinfo_line(line) for line in f if line.strip()]


def parse_mountinfo_line(line: str) -> tuple[str, str]:
    """(mount point, fstype) of one mountinfo line; octal escapes (`\\040` for a space) decoded."""
    fields = line.split()
    fstype = fields[fields.index("-") + 1]
    point = fields[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
    return point, fstype


def is_within(path: str, root: str) -> bool:
    """True when `path` is `root` or below it (both absolute and normalized)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def closed_ancestor(path: str) -> str | None:
    """The highest ancestor of `path` that others may not enter (no o+x), or None."""
    parts = path.strip("/").split("/")[:-1]
    for i in range(len(parts)):
        ancestor = "/" + "/".join(parts[: i + 1])
        if os.path.isdir(ancestor) and not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def bind_fd(fd: int, target: str) -> None:
    """Bind the directory open as `fd` at `target`, creating `target`'s folders in a revealing tmpfs."""
    os.makedirs(target, mode=0o755, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)


def reveal(targets: dict[str, int]) -> set[str]:
    """Cover each closed ancestor of a target with a tmpfs, bind the target back inside it; the bound ones."""
    closed = {target: closed_ancestor(target) for target in targets}
    covered: list[str] = []
    for ancestor in sorted({a for a in closed.values() if a is not None}, key=len):
        if not any(is_within(ancestor, c) for c in covered):
            mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            covered.append(ancestor)
    bound = {target for target, ancestor in closed.items() if ancestor is not None}
    for target in sorted(bound, key=len):
        bind_fd(targets[target], target)
    return bound


def isolate_filesystem(plan: InitPlan) -> None:
    """Workdir writable (its own bind mount), needed paths revealed, everything else read-only."""
    opened = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [plan.workdir, *plan.reveal] if os.path.isdir(p)}
    if plan.workdir not in reveal(opened):
        mount(plan.workdir, plan.workdir, None, MS_BIND | MS_REC)
    for fd in opened.values():
        os.close(fd)
    if plan.etc_dir is not None:
        for name in ("passwd", "group"):
            mount(os.path.join(plan.etc_dir, name), f"/etc/{name}", None, MS_BIND)
    for point, fstype in mount_points():
        if fstype not in PSEUDO_FS and not is_within(point, plan.workdir):
            remount_read_only(point)


def loopback_up() -> None:
    """Bring the loopback interface of this network namespace up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def drop_capabilities() -> None:
    """Uid 0 of a user namespace keeps no capability across exec, and cannot regain one."""
    _check(_libc.prctl(PR_SET_SECUREBITS, SECUREBITS_NO_ROOT, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1


def become_sandbox_user(plan: InitPlan) -> None:
    """Resource limits, then the uid switch or the capability drop, then no new privileges."""
    for name, (soft, hard) in plan.rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if plan.uid is not None and plan.gid is not None:
        os.setgroups([])
        os.setgid(plan.gid)
        os.setuid(plan.uid)
    if plan.drop_caps:
        drop_capabilities()
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def exec_command(plan: InitPlan) -> None:
    """In the forked child: become the sandbox user and exec `bash -c`; exits 126 on a set-up failure."""
    try:
        become_sandbox_user(plan)
        os.chdir(plan.cwd)
        os.execve("/bin/bash", ["bash", "-c", plan.command], plan.env)
    except BaseException as exc:  # noqa: BLE001 - anything before exec is reported, never raised past fork
        os.write(2, f"sandbox: cannot start the command: {exc}\n".encode())
    finally:
        os._exit(126)


def wait_for(child: int) -> str:
    """Reap every process until `child` ends; its status line (`exit N` or `signal N`)."""
    while True:
        pid, status = os.wait()
        if pid == child:
            return f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"


def main() -> int:
    """Read the plan, set up, run, report; the exit code mirrors the status (125 on a set-up failure)."""
    plan = InitPlan(**json.load(sys.stdin))
    os.set_inheritable(plan.status_fd, False)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    try:
        if plan.loopback_up:
            loopback_up()
        if plan.isolate_fs:
            isolate_filesystem(plan)
    except OSError as exc:
        os.write(plan.status_fd, f"error {exc}\n".encode())
        return 125
    child = os.fork()
    if child == 0:
        exec_command(plan)
    status = wait_for(child)
    os.write(plan.status_fd, f"{status}\n".encode())
    return int(status.split()[1]) if status.startswith("exit") else 128 + int(status.split()[1])


if __name__ == "__main__":
    sys.exit(main())
