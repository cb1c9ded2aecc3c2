"""What runs on a Ray node for `agent.executor=ray`: one `NodeRunner` actor per node runs that node's sessions.

`NodeRunner.run(call)` receives everything a session needs as values (a `NodeCall`: command, cwd, env, the
session's `RELAX_*` variables, the input file's text), writes the input into a fresh temporary folder ON THE
NODE, points `RELAX_INPUT_JSON`, `RELAX_OUTPUT_JSON` and `RELAX_SESSION_IO_DIR` at it, and runs the agent with
the local launcher (`AgentProcess`: `bash -c command` in its own process group, the harness variables, the
group ended with SIGTERM, grace, SIGKILL). It answers a `NodeAnswer` (exit code, reason, the output file's text,
the log tail, the node) and removes the folder (on a disk, in a thread the answer does not wait for).
`run_many(calls)` runs a batch of sessions at once and streams each answer back as its session ends (a Ray
streaming generator): one Ray call for the sessions a driver starts together.

Where the folders go (`session_root`): under `ray.node_tmpdir` when set; by default in memory, under /dev/shm when
the node has it memory-backed (tmpfs) with `MEMORY_MIN_FREE` free, else under the node's temp folder: a session's
three file creates (folder, input, log) cost far less in memory than on a disk, and sessions starting at once pay
them one after another (docs/benchmarks.md, "Agents and engines on Ray"). `ping` answers the node's
choice (`NodeFolder`); the driver names it in one line at start. The files are small (the input, the agent's
output, its log); an agent that logs gigabytes should get a disk folder through `ray.node_tmpdir`.
`cancel(session_id)` ends a running session's process group and
waits for it; `kill(session_id)` SIGKILLs it without waiting. The active-time budget is not counted here: the
driver keeps the `ActiveTimer` (paused while the group lease is not held) and calls `cancel` when it runs out.

The agent's main process also gets SIGKILL when the runner's worker dies (`PR_SET_PDEATHSIG`), so a lost or
stopped runner does not leave it behind; processes it started in turn are not followed.

Spawning never blocks the actor's loop (many sessions arrive at once): the process is started with a plain
`subprocess.Popen` (vfork + exec) in one of `SPAWN_THREADS` threads the runner keeps for its whole life, and its
exit is awaited through a pidfd watched by the loop (`infra.processes.ChildProcess`). A spawn costs the runner
little CPU but waits until its child has exec'd, so spawns in turn on the loop would make the last of a node's
sessions wait for all the others; in threads they overlap. The death signal is set by exec'ing through
`setpriv --pdeathsig KILL` (util-linux), which keeps the vfork path; only on a node without it does the child run
`prctl` itself in a `preexec_fn`, which forces a full fork of the large worker process. The spawn costs are on the
benchmarks page (docs/benchmarks.md, "Agents and engines on Ray"). The death signal follows the thread that
started the child, which is why the spawn threads never end while the runner lives.

One actor serves many sessions at once (an asyncio actor): a Ray worker per session would cost a Python
process, its memory and its start-up, for every agent. Ray is not imported here: `ray_executor` wraps the class.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from relax_pipeline.agent.launcher import RESERVED_PREFIX, AgentFailure, AgentProcess, AgentSpec
from relax_pipeline.infra.processes import ChildProcess, death_wrapper, die_with_parent


@dataclass(frozen=True)
class NodeCall:
    """One session as it travels to a node; connects `RayAgent.start` to `NodeRunner.run`."""

    session_id: str
    """The session (`RELAX_SESSION_ID`); names the node's temporary folder and keys `cancel`."""
    command: str
    """`agent.command`, run with `bash -c`."""
    cwd: str | None
    """`agent.cwd`, a path on the node; None keeps the runner's working folder."""
    env: dict[str, str]
    """`agent.env`."""
    session_env: dict[str, str]
    """The session's `RELAX_*` variables except the three file paths, which the node sets."""
    input_text: str
    """The input file's content."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL of the group."""
    log_tail_bytes: int = 8192
    """How much of the end of the agent's log comes back."""
    nice: int | None = None
    """`agent.nice`: how much lower the agent's CPU priority is on the node."""


@dataclass(frozen=True)
class NodeAnswer:
    """A finished session as it comes back from the node; connects `NodeRunner.run` to `RayAgent.wait`."""

    exit_code: int | None
    """The agent's exit code; None when it died by a signal or could not start."""
    reason: str | None
    """Why it failed (`AgentFailure.reason`), None after exit 0."""
    output: str | None
    """The output file's text; None when the agent wrote none (implicit export)."""
    log: str
    """The tail of the agent's stdout and stderr."""
    node: str = ""
    """`host (node id)` of the node that ran it."""
    folder: str = field(default="", compare=False)
    """The node-local folder it ran in (removed since)."""
    marks: dict[str, float] = field(default_factory=dict, compare=False)
    """Epoch seconds on the node: `received` (the call arrived), `spawned` (the process started), `exited`
    (its group ended), `answered` (the answer was built); where the node spends a session's time."""
    session_id: str = ""
    """The session it answers (`NodeCall.session_id`): `run_many` answers in the order the sessions end."""


SPAWN_THREADS = 4
"""Threads a node's runner spawns sessions in (see the module): spawns overlap while each waits for its child's
exec; more threads gained little more on 2 cores."""
MEMORY_FOLDER = "/dev/shm"
"""The memory-backed folder a node keeps session folders in by default (`session_root`)."""
MEMORY_MIN_FREE = 1 << 30
"""Free bytes `MEMORY_FOLDER` needs to be the default: Docker gives containers 64 MiB there, which a few hundred
agents' logs could fill (and Ray's object store may share it)."""
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystem types whose files live in memory."""


@dataclass(frozen=True)
class NodeFolder:
    """Where a node keeps its session folders; connects `NodeRunner.ping` to the driver's start line."""

    node: str
    """The node's name."""
    path: str
    """The folder session folders are made under."""
    memory: bool
    """Whether it is memory-backed (tmpfs, ramfs)."""
    configured: bool
    """True when `ray.node_tmpdir` named it, False when the node chose it (`session_root`)."""


def session_root(tmpdir: str | None, node: str) -> NodeFolder:
    """Where session folders go on this node: `tmpdir` (`ray.node_tmpdir`) when set, refused unless writable;
    else `MEMORY_FOLDER` when it is memory-backed, writable and has `MEMORY_MIN_FREE` free; else the temp folder."""
    if tmpdir is not None:
        if not _writable(tmpdir):
            raise ValueError(f"ray.node_tmpdir={tmpdir!r} is not a writable folder on node {node}; create it on every "
                             "node or set ray.node_tmpdir=null (the node's own choice: /dev/shm, else its temp folder)")
        return NodeFolder(node, tmpdir, memory_backed(tmpdir), configured=True)
    if memory_backed(MEMORY_FOLDER) and _writable(MEMORY_FOLDER) and _free_bytes(MEMORY_FOLDER) >= MEMORY_MIN_FREE:
        return NodeFolder(node, MEMORY_FOLDER, True, configured=False)
    fallback = tempfile.gettempdir()
    return NodeFolder(node, fallback, memory_backed(fallback), configured=False)


def memory_backed(path: str) -> bool:
    """Whether `path` lies on a memory-backed filesystem (its mount's type, from /proc/self/mounts)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:  # not Linux: nothing is known to be in memory
        return False
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind in MEMORY_FILESYSTEMS


def _writable(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _free_bytes(path: str) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


@functools.cache
def _wrapper() -> tuple[str, ...]:
    """`death_wrapper()` with its program as a full path, so a spawn does not search PATH."""
    wrapper = death_wrapper()
    return (shutil.which(wrapper[0]) or wrapper[0], *wrapper[1:]) if wrapper else ()


@functools.cache
def _node_environment() -> tuple[tuple[str, str], ...]:
    """The runner's environment without RELAX_* variables, read once: a node's does not change while it runs, and
    decoding os.environ for every session was a fifth of the runner's CPU per session."""
    return tuple((k, v) for k, v in os.environ.items() if not k.startswith(RESERVED_PREFIX))


class NodeProcess(AgentProcess):
    """`AgentProcess` started the cheap way (see the module) whose main process dies with the thread that started
    it: one of `spawner`'s threads, or the caller's when `spawner` is None."""

    def __init__(self, spec: AgentSpec, spawner: Executor | None = None) -> None:
        super().__init__(spec)
        self.spawner = spawner

    def _base_environment(self) -> dict[str, str]:
        return dict(_node_environment())

    async def _spawn(self, env: dict[str, str], log_path: Path) -> asyncio.subprocess.Process:
        start = functools.partial(_popen, ("bash", "-c", self.spec.command), self.spec.cwd, env, log_path)
        try:
            popen = start() if self.spawner is None else await asyncio.get_running_loop().run_in_executor(
                self.spawner, start)
        except OSError as error:
            raise AgentFailure(f"could not start on {socket.gethostname()} ({error}); check agent.cwd (a path on "
                               "the node) and agent.command", None, "") from error
        return ChildProcess(popen)  # type: ignore[return-value]  # the part of Process that AgentProcess uses


def _popen(command: tuple[str, ...], cwd: str | None, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start `command` through the death wrapper in its own session, its output appended to `log_path`."""
    wrapper = _wrapper()
    with open(log_path, "ab") as log:
        return subprocess.Popen([*wrapper, *command], cwd=cwd, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=log.fileno(), stderr=subprocess.STDOUT,
                                preexec_fn=None if wrapper else die_with_parent)


class NodeRunner:
    """Runs the sessions Ray sends to this node (see the module); one per node, many sessions at once."""

    def __init__(self, node: str = "", tmpdir: str | None = None) -> None:
        self.node = node or socket.gethostname()
        self.folder = session_root(tmpdir, self.node)
        """Where session folders go: `ray.node_tmpdir`, else the node's choice (`session_root`)."""
        _wrapper()  # probed now, not on the first session's spawn
        self._spawner = ThreadPoolExecutor(SPAWN_THREADS, thread_name_prefix="relax-spawn")
        """Where sessions are spawned; never shut down while the runner lives (the agents' death signal follows
        the thread that spawned them)."""
        self._agents: dict[str, AgentProcess] = {}
        self._cancelled: set[str] = set()
        """Sessions cancelled before or while they started (a cancel may overtake the start)."""

    def ping(self) -> NodeFolder:
        """Once the actor is up: the node's name and where its session folders go."""
        return self.folder

    async def run(self, call: NodeCall, folder: Path | None = None) -> NodeAnswer:
        """Run one session to its end on this node (see the module), in `folder` when `prepare` made it."""
        marks = {"received": time.time()}
        folder = folder or self.prepare(call)
        process = NodeProcess(AgentSpec(command=call.command, cwd=call.cwd, env=dict(call.env), timeout=None,
                                        grace_s=call.grace_s, log_tail_bytes=call.log_tail_bytes, nice=call.nice),
                              self._spawner)
        self._agents[call.session_id] = process
        try:
            reason = await self._run(process, call, folder, marks)
            output = folder / "output.json"
            text = output.read_text(errors="replace") if output.exists() else None
            code = process.returncode
            marks["answered"] = time.time()
            return NodeAnswer(code if code is not None and code >= 0 else None, reason, text, process.tail(),
                              self.node, str(folder), marks, call.session_id)
        finally:
            self._agents.pop(call.session_id, None)
            self._cancelled.discard(call.session_id)
            await asyncio.shield(process.terminate())
            self._remove(folder)

    async def run_many(self, calls: list[NodeCall]) -> AsyncIterator[list[NodeAnswer]]:
        """Run the sessions of one batch at once and yield their answers as they end, those that ended together
        as one list (Ray streams the items back: one call per node for the sessions a driver starts together, and
        one item, whose CPU is paid between the node and the driver, for the sessions that end together). A session
        the runner fails to run answers a failure naming the error; the others go on."""
        if self.folder.memory:
            folders = self._prepare_all(calls)
        else:
            folders = await asyncio.get_running_loop().run_in_executor(None, self._prepare_all, calls)
        pending = {asyncio.ensure_future(self._run_or_fail(c, f)) for c, f in zip(calls, folders, strict=True)}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            yield [run.result() for run in done]

    def prepare(self, call: NodeCall) -> Path:
        """A fresh folder for the session (under `self.folder`) with its input file; the log is made by the spawn."""
        folder = Path(tempfile.mkdtemp(prefix=f"relax-{call.session_id[:24]}-", dir=self.folder.path))
        (folder / "input.json").write_text(call.input_text)
        return folder

    def _prepare_all(self, calls: list[NodeCall]) -> list[Path | Exception]:
        """`prepare` for a batch: on the loop in memory (cheap), in a thread on a disk (file creates wait on it, while
        the loop goes on starting earlier batches' sessions)."""
        folders: list[Path | Exception] = []
        for call in calls:
            try:
                folders.append(self.prepare(call))
            except OSError as error:
                folders.append(error)
        return folders

    def _remove(self, folder: Path) -> None:
        """Remove a finished session's folder: at once in memory, in a thread on a disk (not waited for: the answer
        does not need it)."""
        if self.folder.memory:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            asyncio.get_running_loop().run_in_executor(None, functools.partial(shutil.rmtree, folder, True))

    async def _run_or_fail(self, call: NodeCall, folder: Path | Exception | None = None) -> NodeAnswer:
        try:
            if isinstance(folder, Exception):
                raise folder
            return await self.run(call, folder)
        except Exception as error:  # a bug or a broken node: this session fails, its batch goes on
            return NodeAnswer(None, f"failed on the runner: {type(error).__name__}: {error}", None, "", self.node,
                              session_id=call.session_id)

    async def _run(self, process: AgentProcess, call: NodeCall, folder: Path, marks: dict[str, float]) -> str | None:
        """Start and wait; the failure's reason, None after exit 0."""
        env = {**call.session_env, "RELAX_INPUT_JSON": str(folder / "input.json"),
               "RELAX_OUTPUT_JSON": str(folder / "output.json"), "RELAX_SESSION_IO_DIR": str(folder)}
        if call.session_id in self._cancelled:
            return "cancelled before it started"
        try:
            await process.start(env, folder)
            marks["spawned"] = time.time()
            if call.session_id in self._cancelled:
                await process.terminate()
            await process.wait()
        except AgentFailure as failure:
            return failure.reason
        finally:
            marks["exited"] = time.time()
        return None

    async def cancel(self, session_id: str) -> bool:
        """End the session's process group (SIGTERM, grace, SIGKILL) and wait; False when it is not running."""
        self._cancelled.add(session_id)
        process = self._agents.get(session_id)
        if process is None:
            return False
        await process.terminate()
        return True

    def kill(self, session_id: str) -> None:
        """SIGKILL the session's group at once (the run's last resort)."""
        process = self._agents.get(session_id)
        if process is not None:
            process.kill()

    def cpu_seconds(self) -> float:
        """CPU seconds this runner's process has used (every thread: its loop, Ray's, the file threads); the agents'
        own processes are not counted. `bench/agents_ray.py` divides the difference by the sessions run."""
        return time.process_time()

    def running(self) -> int:
        """Sessions running on this node now."""
        return len(self._agents)
