"""Start one agent process per session and end its whole process group (docs/design.md §3.2).

`AgentProcess.start` runs `bash -c <command>` in `cwd`, in a new session (so its own process group, and no
controlling terminal: a Ctrl-C, which the terminal sends to its foreground process group, reaches the run but
never the agents; the run's stop path terminates them), with stdin from /dev/null and stdout and stderr
appended to one file, `<io_dir>/agent.log`. The environment is the parent's, minus any inherited `RELAX_*`
variable, plus `AgentSpec.env`, plus the session's `RELAX_*` variables passed by the caller, plus the
variables real harnesses read for their endpoint (`harness_variables`: `OPENAI_BASE_URL`, `OPENAI_API_KEY`,
`ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`, derived from `RELAX_BASE_URL` and `RELAX_API_KEY`, each unless
`AgentSpec.env` sets it), so a harness configured by its own variables needs no wrapper and never reaches a
real provider with a key inherited from the parent. The `RELAX_` prefix is reserved: `AgentSpec.env` may not
use it and the session variables must.

`AgentProcess.wait` counts an `ActiveTimer`: time spent paused (for example while the agent's request waits
for the engine) does not count against `AgentSpec.timeout`. When the budget runs out, or when the waiting task
is cancelled (session dropped), the whole group gets SIGTERM, then SIGKILL after `grace_s`. After a normal
exit of the main process, leftover processes of the group are ended the same way. A non-zero exit, a death by
signal and a timeout raise `AgentFailure` carrying the exit code, the tail of the log and its kind
(`FAILURE_KINDS`: the agent's error, a timeout, or an infrastructure failure). `wait_active` is that
active-time wait on its own, shared with `agent/http_executor` (the same budget for a session run by an agent
server); `kill` is the no-wait SIGKILL of a run's last resort.

Not done here: processes that leave the group (`setsid`, double-forking daemons) are not followed;
writing the input file and reading the output file live in `session_io`.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from relax_pipeline.infra.processes import ChildProcess

RESERVED_PREFIX = "RELAX_"
"""Environment prefix owned by the pipeline; user env may not set it."""
LOG_NAME = "agent.log"
"""File in the session io dir that receives the agent's stdout and stderr."""
_POLL_S = 0.05
"""How often a paused timer, or a terminating group, is looked at again."""


class ActiveTimer:
    """An active-time budget: counts seconds only while running; `budget=None` never expires."""

    def __init__(self, budget: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._clock = clock
        self._spent = 0.0
        self._since: float | None = None
        self._started = False

    def start(self) -> None:
        """Begin counting; a timer starts once."""
        if self._started:
            raise RuntimeError("ActiveTimer.start() called twice; use resume() after pause()")
        self._started = True
        self._since = self._clock()

    def pause(self) -> None:
        """Stop counting until `resume`; no-op when not running."""
        if self._since is not None:
            self._spent += self._clock() - self._since
            self._since = None

    def resume(self) -> None:
        """Count again after `pause`; no-op when running."""
        if not self._started:
            raise RuntimeError("ActiveTimer.resume() before start(); call start() first")
        if self._since is None:
            self._since = self._clock()

    @property
    def started(self) -> bool:
        """True once `start` was called."""
        return self._started

    @property
    def running(self) -> bool:
        """True between start/resume and pause."""
        return self._since is not None

    def elapsed(self) -> float:
        """Active seconds counted so far."""
        live = self._clock() - self._since if self._since is not None else 0.0
        return self._spent + live

    def remaining(self) -> float:
        """Active seconds left, never below 0; `math.inf` without a budget."""
        return math.inf if self.budget is None else max(0.0, self.budget - self.elapsed())

    @property
    def expired(self) -> bool:
        """True once the active time reached the budget."""
        return self.budget is not None and self.elapsed() >= self.budget


AGENT_EXECUTORS = ("local", "http", "ray")
"""Where agents run (`agent.executor`): a local process group per session, a session sent to an agent server, or a
session run on a node of a Ray cluster (`agent/ray_executor.py`)."""


@dataclass
class AgentSettings:
    """The `agent` group's node: how to run the user's harness (every `agent=` option sets these keys)."""

    command: str
    """Shell command run by `bash -c` once per session."""
    cwd: str | None = None
    """Working directory of the agent process; None keeps the run's."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (the RELAX_ prefix is reserved)."""
    timeout: float | None = 120.0
    """Active-time budget in seconds (paused time excluded); None means no limit."""
    multi_context: bool = False
    """Sessions export several training contexts; needs credit=custom_advantage and dynamic batching
    (trainer.batching.use_dynamic_batch_size); checked at start and, per session, by stages/reward."""
    executor: str = "local"
    """local (one process group per session on this machine), http (each session is POSTed to
    agent.server_url, an agent server that runs it; docs/agentic-rollout.md has the contract) or ray (each session
    runs on a node of the Ray cluster at ray.address; files travel with the call, no shared disk)."""
    resources: dict[str, float] = field(default_factory=dict)
    """executor=ray: what one session holds on its node ({num_cpus: 1}, {num_gpus: 1}, {sandbox: 1} for a custom
    resource); a node runs as many sessions at once as its Ray resources allow; {}: no limit."""
    server_url: str | None = None
    """executor=http: base URL of the agent server (its POST /sessions runs one session)."""
    nice: int | None = None
    """executor=local and ray: lower each agent's CPU priority by this much (0-19, `lower_priority`), so the run's
    engine, gateway and trainer win the cores when many agents start at once (Linux: the agent's session, all its
    processes); null: unchanged."""
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Processes started once per run before the first rollout, health-checked, stopped at the end, by name:
    command, cwd, env, port, health_url, startup_timeout (`agent/services.py` checks each entry); logs in
    `<output>/services/<name>.log`."""

    def __post_init__(self) -> None:
        reserved = sorted(k for k in self.env if str(k).startswith(RESERVED_PREFIX))
        if reserved:
            raise ValueError(f"agent.env sets {reserved}: the RELAX_ prefix is reserved; rename these keys")
        if self.nice is not None and not (isinstance(self.nice, int) and 0 <= self.nice <= 19):
            raise ValueError(f"agent.nice={self.nice!r}: use an integer from 0 to 19 (how much lower the agents' "
                             "CPU priority is), or null")
        if self.executor not in AGENT_EXECUTORS:
            raise ValueError(f"agent.executor={self.executor!r} is not an executor; choose one of "
                             f"{list(AGENT_EXECUTORS)}")
        for key, value in self.resources.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"agent.resources.{key}={value!r} must be a number >= 0 (what one session holds)")
        if self.executor == "http" and not self.server_url:
            raise ValueError("agent.executor=http needs agent.server_url (the agent server's base URL, for example "
                             "http://127.0.0.1:8700); or use agent.executor=local")


@dataclass
class AgentSpec(AgentSettings):
    """The `agent` node plus what the run adds (the sandbox limits and Ray keys) and the process-handling
    constants; connects the `agent` config group to `AgentProcess` and the other executors."""

    timeout: float | None = None
    """Active-time budget in seconds (paused time excluded); None is unlimited."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL of the process group."""
    log_tail_bytes: int = 8192
    """How much of the end of agent.log a failure carries."""
    sandbox: dict[str, Any] = field(default_factory=dict)
    """The run's `sandbox.*` limits, sent with every executor=http session (`agent/sandbox.py` applies them)."""
    ray: dict[str, Any] = field(default_factory=dict)
    """executor=ray: the run's `ray.*` keys (address, num_cpus, runtime_env; `infra/ray_runtime.py`)."""

    @classmethod
    def of(cls, settings: AgentSettings, sandbox: dict[str, Any], ray: dict[str, Any]) -> AgentSpec:
        """The spec of an `agent` node, with the run's sandbox limits and Ray keys."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(AgentSettings)}, sandbox=sandbox, ray=ray)

    def with_keys(self, keys: dict[str, Any], where: str) -> AgentSpec:
        """This spec with some `agent.*` keys replaced (an eval pool's); an unknown key fails naming `where`."""
        known = {f.name for f in fields(AgentSettings)}
        for key in keys:
            if key not in known:
                raise ValueError(f"{where}.{key} is not an agent key; use one of {sorted(known)} (and slots)")
        return replace(self, **keys)


@dataclass(frozen=True)
class AgentExit:
    """A successful agent run; connects `AgentProcess.wait` to output parsing."""

    exit_code: int
    """Always 0 (any other exit raises `AgentFailure`)."""
    elapsed_s: float
    """Wall seconds from start to exit."""
    active_s: float
    """Seconds counted by the active timer."""


def harness_variables(session_env: Mapping[str, str]) -> dict[str, str]:
    """The endpoint variables the OpenAI and Anthropic SDKs (and harnesses built on them) read themselves."""
    base, key = session_env.get("RELAX_BASE_URL"), session_env.get("RELAX_API_KEY")
    if not base or not key:
        return {}
    return {"OPENAI_BASE_URL": base.rstrip("/") + "/v1", "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": base.rstrip("/"), "ANTHROPIC_API_KEY": key}


FAILURE_KINDS = ("agent_error", "timeout", "infra_error")
"""What an `AgentFailure` was (the session outcomes of the same names, `stages/group.py`): the agent's own failure
(a non-zero exit, a death by signal, a bad answer from its server), its active-time budget ran out, or the
machinery around it failed (it could not be started, its server or node could not be reached or was lost)."""
_INFRA_PREFIXES = ("could not start", "could not reach", "could not read the input file", "agent server answered",
                   "lost:", "failed on node", "no node of", "the node's runner")
"""Reasons of the executors' infrastructure failures (`http_executor`, `ray_executor`, `ray_node`)."""


def failure_kind(reason: str) -> str:
    """The kind of a failure from its reason, for executors that do not name it (`FAILURE_KINDS`)."""
    if reason.startswith("timed out"):
        return "timeout"
    return "infra_error" if reason.startswith(_INFRA_PREFIXES) else "agent_error"


class AgentFailure(Exception):
    """The agent exited non-zero, died by a signal, or ran out of active time; or it could not be run at all.

    `kind` is one of `FAILURE_KINDS` (named by the raiser, else read from the reason by `failure_kind`)."""

    def __init__(
        self, reason: str, exit_code: int | None, log_tail: str, log_path: Path | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(reason, exit_code, log_tail)
        self.reason = reason
        self.exit_code = exit_code
        self.log_tail = log_tail
        self.log_path = log_path
        self.kind = kind or failure_kind(reason)
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"AgentFailure kind={self.kind!r}; choose one of {list(FAILURE_KINDS)}")

    def __str__(self) -> str:
        where = f" (full log: {self.log_path})" if self.log_path else ""
        return f"agent {self.reason}{where}; last output:\n{self.log_tail}"


class AgentProcess:
    """One agent process group: start it, wait on it under the active timer, terminate it."""

    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec
        self.timer = ActiveTimer(spec.timeout)
        self._proc: asyncio.subprocess.Process | None = None
        self._log_path: Path | None = None
        self._started_at = 0.0
        self._exited_at = 0.0
        self._group_gone = False

    @property
    def pid(self) -> int | None:
        """Pid (and process group id) of the main process, None before start."""
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """The main process's return code (negative: killed by that signal), None while it runs."""
        return self._proc.returncode if self._proc else None

    async def start(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Launch `bash -c command` in its own process group, logging to `io_dir/agent.log`."""
        if self._proc is not None:
            raise RuntimeError("AgentProcess.start() called twice; use one AgentProcess per session")
        io_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = io_dir / LOG_NAME
        self._proc = await self._spawn(self._environment(session_env), self._log_path)
        if self.spec.nice:
            lower_priority(self._proc.pid, self.spec.nice)
        self._started_at = time.monotonic()
        self.timer.start()

    def _environment(self, session_env: Mapping[str, str]) -> dict[str, str]:
        """Parent env without inherited RELAX_* vars, then the spec's env, then the session's."""
        foreign = sorted(k for k in session_env if not k.startswith(RESERVED_PREFIX))
        if foreign:
            raise ValueError(f"session env {foreign} lacks the RELAX_ prefix; put user variables in "
                             "agent.env")
        env = self._base_environment()
        env.update(harness_variables(session_env))
        env.update({str(k): str(v) for k, v in self.spec.env.items()})
        env.update({k: str(v) for k, v in session_env.items()})
        return env

    def _base_environment(self) -> dict[str, str]:
        """This process's environment without inherited RELAX_* variables (a fresh dict)."""
        return {k: v for k, v in os.environ.items() if not k.startswith(RESERVED_PREFIX)}

    async def _spawn(self, env: dict[str, str], log_path: Path) -> asyncio.subprocess.Process:
        """Create the subprocess, its output appended to `log_path`; a missing cwd or bash is an `AgentFailure`.
        A plain `Popen` (vfork + exec) watched through a pidfd (`infra.processes.ChildProcess`), not
        `create_subprocess_exec`, whose watcher starts a thread per child (Python 3.11): at a step's start, while
        the trainer's thread computes, a hundred such threads each took the GIL."""
        try:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    ["bash", "-c", self.spec.command], cwd=self.spec.cwd, env=env, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=log.fileno(), stderr=subprocess.STDOUT)
            return ChildProcess(popen)  # type: ignore[return-value]  # the part of Process used here
        except OSError as error:
            raise AgentFailure(f"could not start ({error}); check agent.cwd and agent.command", None,
                               "", self._log_path, "infra_error") from error

    async def wait(self) -> AgentExit:
        """Wait for exit under the active timer; raise `AgentFailure` unless it exits 0."""
        proc = self._require_started()
        try:
            finished = await self._wait_active(proc)
        except asyncio.CancelledError:
            await asyncio.shield(self.terminate())
            raise
        if not finished:
            await self.terminate()
            raise self._failure(f"timed out after {self.timer.budget:g} s of active time", None, "timeout")
        await self.terminate()
        return self._result(proc)

    async def _wait_active(self, proc: asyncio.subprocess.Process) -> bool:
        """True when the main process exited, False when the active budget ran out first."""
        waiter = asyncio.ensure_future(proc.wait())
        try:
            finished = await wait_active(self.timer, waiter)
        finally:
            waiter.cancel()
        self._exited_at = time.monotonic()
        return finished

    def _result(self, proc: asyncio.subprocess.Process) -> AgentExit:
        """AgentExit for exit 0, else the matching `AgentFailure`."""
        code = proc.returncode
        assert code is not None
        if code < 0:
            raise self._failure(f"killed by signal {_signal_name(-code)}", None)
        if code > 0:
            raise self._failure(f"exited with code {code}", code)
        return AgentExit(exit_code=0, elapsed_s=self._exited_at - self._started_at,
                         active_s=self.timer.elapsed())

    async def terminate(self) -> None:
        """SIGTERM the group, wait up to grace_s for it to empty, then SIGKILL it; idempotent."""
        if self._proc is None or self._group_gone:
            return
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.spec.grace_s
        while _group_alive(self._proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        self._signal_group(signal.SIGKILL)
        await self._proc.wait()
        self._group_gone = not _group_alive(self._proc.pid)

    def kill(self) -> None:
        """SIGKILL the whole group at once, without waiting (the run's last resort before it exits)."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _signal_group(self, sig: signal.Signals) -> None:
        """Send `sig` to the whole group; a group that is already gone is fine."""
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            self._group_gone = True

    def tail(self) -> str:
        """The last `log_tail_bytes` of agent.log, decoded with replacement characters."""
        return log_tail(self._log_path, self.spec.log_tail_bytes)

    def _failure(self, reason: str, exit_code: int | None, kind: str = "agent_error") -> AgentFailure:
        """An `AgentFailure` carrying the log tail."""
        return AgentFailure(reason, exit_code, self.tail(), self._log_path, kind)

    def _require_started(self) -> asyncio.subprocess.Process:
        """The running process, or a RuntimeError naming the missing call."""
        if self._proc is None:
            raise RuntimeError("AgentProcess.wait() before start(); call start() first")
        return self._proc


def log_tail(path: Path | None, limit: int) -> str:
    """The last `limit` bytes of the file at `path` decoded with replacement characters; "" when absent."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - limit))
        return log.read().decode("utf-8", errors="replace")


async def wait_active(timer: ActiveTimer, waiter: asyncio.Future[Any]) -> bool:
    """Wait for `waiter` while `timer` has active time left: True when it finished, False when the budget ran
    out first. Time spent paused does not count; the timer is paused on return. `waiter` is left running
    (the caller cancels or keeps it); cancelling this wait cancels nothing else."""
    try:
        while not waiter.done():
            if timer.expired:
                return False
            await asyncio.wait({waiter}, timeout=_slice(timer))
        return True
    finally:
        timer.pause()


def _slice(timer: ActiveTimer) -> float | None:
    """How long to wait before looking at the timer again."""
    if not timer.running:
        return _POLL_S
    remaining = timer.remaining()
    return None if math.isinf(remaining) else remaining


def _signal_name(signum: int) -> str:
    """SIGTERM-style name of a signal number."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def lower_priority(pid: int, nice: int) -> None:
    """Best effort, Linux: `nice` for the autogroup of `pid`'s session (with autogroup scheduling on, the CPU is
    shared between sessions, and each agent is a session of its own; this covers every process of the session,
    those already forked too) and for the process itself (what counts where autogroup is off)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")
    except OSError:  # no autogroup in this kernel, or the process is gone
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:
        pass


def _group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _has_live_member(pgid)


def _has_live_member(pgid: int) -> bool:
    """Scan /proc for a non-zombie process in group `pgid` (zombies wait on a non-reaping init)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if entry.name.isdigit() and _stat_is_live_member(entry / "stat", pgid):
            return True
    return False


def _stat_is_live_member(stat_path: Path, pgid: int) -> bool:
    """Whether /proc/<pid>/stat shows a live (non-zombie) process in group `pgid`."""
    try:
        fields = stat_path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[2] == str(pgid) and fields[0] not in ("Z", "X")
