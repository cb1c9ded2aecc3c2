"""The unit tier's guard: a unit test that starts a process or opens a server socket fails, naming where it goes.

`tests/unit` runs no subprocess and no server (docs/layout.md), so the tier stays fast and runs anywhere. Every unit
test runs with the ways to start a process (`subprocess.Popen` and everything built on it, `os.system`, `os.fork`,
`os.forkpty`, `os.posix_spawn[p]`, `asyncio.create_subprocess_*`, multiprocessing's spawn and forkserver through
`_posixsubprocess.fork_exec`) and to serve on a socket (`socket.bind`, `socket.listen`) replaced by a call that
fails the test. Each attempt is also recorded and checked at teardown, so a caller that swallows the failure
(a broad `except BaseException`, a worker thread) still fails its test.

What it does not do: stop client sockets (a unit test may still connect somewhere, and should not), or look at
import-time code (a module that starts a process when imported fails outside any test).
"""

from __future__ import annotations

import _posixsubprocess
import asyncio
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PROCESS_MESSAGE = "the unit tier runs no subprocess; move this test to tests/integration"
SERVER_MESSAGE = "the unit tier runs no server; move this test to tests/integration"

PROCESS_CALLS: tuple[tuple[Any, str, str], ...] = (
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec (multiprocessing)"),
    (os, "system", "os.system"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (asyncio, "create_subprocess_exec", "asyncio.create_subprocess_exec"),
    (asyncio, "create_subprocess_shell", "asyncio.create_subprocess_shell"),
)
"""Every way to start a process that the guard replaces, as (owner, attribute, the name a failure shows); those
missing on this platform are left alone."""
SERVER_CALLS: tuple[tuple[Any, str, str], ...] = (
    (socket.socket, "bind", "socket.bind"),
    (socket.socket, "listen", "socket.listen"),
)
"""The socket calls that make a server."""


def _refuse(attempts: list[str], name: str, message: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        attempts.append(f"{name} called: {message}")
        pytest.fail(attempts[-1])

    return refused


CALL_FAILED = pytest.StashKey[bool]()
"""Whether a test's call phase failed (kept by `pytest_runtest_makereport`)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Keep the call phase's report on the item, so the guard's teardown knows whether the test already failed."""
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def no_process_no_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test when it starts a process or binds/listens on a socket (module docstring)."""
    attempts: list[str] = []
    for calls, message in ((PROCESS_CALLS, PROCESS_MESSAGE), (SERVER_CALLS, SERVER_MESSAGE)):
        for owner, attribute, name in calls:
            if hasattr(owner, attribute):
                monkeypatch.setattr(owner, attribute, _refuse(attempts, name, message))
    yield
    if attempts and not request.node.stash.get(CALL_FAILED, False):
        pytest.fail("; ".join(dict.fromkeys(attempts)) + " (the test caught the failure)", pytrace=False)
