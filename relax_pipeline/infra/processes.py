"""Child processes as every floor starts them: an exit watch on the event loop, death signals, group signals.

`ChildProcess` shows a `subprocess.Popen` the way an asyncio process looks (`pid`, `returncode`, `await wait()`),
its exit watched through a pidfd on the running loop: no thread per child (Python 3.11's asyncio child watcher
starts one per child) and no full fork (a plain `Popen` is vfork + exec). Death signals make a child die with
the thread that started it (Linux `PR_SET_PDEATHSIG`): `death_wrapper()` is the `setpriv --pdeathsig KILL`
command prefix that keeps the cheap spawn path, `die_with_parent` the `preexec_fn` used where that tool is
missing (it forces a full fork). `exit_when_orphaned` is the same promise seen from the child: a Python process
that exits once its parent is gone. `signal_group` signals a process group that may already be gone.

Not done here: starting processes (each caller builds its own command, environment and log), process trees that
leave their group (`setsid`, double forks), anything but Linux semantics (elsewhere the death signal is a no-op).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import shutil
import signal
import subprocess
import threading
import time

PR_SET_PDEATHSIG = 1
"""prctl option: the signal a child gets when the thread that started it exits."""
DEATH_WRAPPER = ("setpriv", "--pdeathsig", "KILL", "--")
"""The command prefix that sets a child's death signal before it execs its command (util-linux >= 2.33)."""
_POLL_S = 0.05
"""How often a child is polled where no pidfd can watch it."""


class ChildProcess:
    """A `subprocess.Popen` seen as an asyncio process (`pid`, `returncode`, `await wait()`): its exit is watched
    with a pidfd on the running loop, no thread; any number of waiters, each cancellable."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self._exited: asyncio.Future[int] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def wait(self) -> int:
        """The exit code (negative: the signal), once the process exited; reaps it."""
        if self.popen.returncode is not None:
            return self.popen.returncode
        if self._exited is None:
            self._exited = self._watch()
        return await asyncio.shield(self._exited)

    def _watch(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3: poll
            return asyncio.ensure_future(self._poll())
        exited: asyncio.Future[int] = loop.create_future()
        loop.add_reader(fd, self._on_exit, loop, fd, exited)
        return exited

    def _on_exit(self, loop: asyncio.AbstractEventLoop, fd: int, exited: asyncio.Future[int]) -> None:
        """The pidfd became readable: the process exited; reap it and stop watching."""
        code = self.popen.poll()
        if code is None:
            return
        loop.remove_reader(fd)
        os.close(fd)
        if not exited.done():
            exited.set_result(code)

    async def _poll(self) -> int:
        while (code := self.popen.poll()) is None:
            await asyncio.sleep(_POLL_S)
        return code


@functools.cache
def death_wrapper() -> tuple[str, ...]:
    """`DEATH_WRAPPER` when it works on this machine (checked once per process), else () (then `preexec_fn`)."""
    if shutil.which(DEATH_WRAPPER[0]) is None:
        return ()
    try:
        probe = subprocess.run([*DEATH_WRAPPER, "true"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return DEATH_WRAPPER if probe.returncode == 0 else ()


def die_with_parent() -> None:
    """A `preexec_fn`: in the child before exec, ask for SIGKILL when the starting thread exits (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def exit_when_orphaned(parent: int, code: int = 3, every_s: float = 1.0) -> None:
    """In a child: `os._exit(code)` once this process's parent is no longer `parent` (it died, even by SIGKILL).
    Watched by a daemon thread that looks every `every_s` seconds."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(code)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def signal_group(pid: int, signum: int) -> bool:
    """Send `signum` to the process group `pid` leads; False when the group is already gone."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        return False
    return True
