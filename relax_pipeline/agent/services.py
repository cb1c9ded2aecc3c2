"""`agent.services`: helper processes started once per run (a retrieval index, a tool server), not per session.

`Services(services, output_dir)` takes `AgentSpec.services` (name → `{command, cwd, env, port, health_url,
startup_timeout}`) and checks every entry at once (`ServiceSpec.parse`): unknown keys, a missing command, a
`RELAX_` variable in `env` and a bad timeout are errors naming `agent.services.<name>.<key>` and the fix.

`await Services.start()` starts them in order, each with `bash -c command` in `cwd`, in its own session (so its
own process group), stdin from /dev/null, stdout and stderr appended to `<output_dir>/services/<name>.log`, with
the parent environment minus inherited `RELAX_*` variables plus `env`. It then polls `health_url` (GET, httpx)
until a 2xx answer; a service without one is ready once started. If the process exits first, or
`startup_timeout` seconds pass, everything started so far is stopped and a `ServiceFailure` names the service,
the reason, the log path and the log tail. `await Services.stop()` ends every group in reverse order: SIGTERM,
`grace_s`, SIGKILL (the launcher's group helpers); it is idempotent. `Services.kill()` is the no-wait SIGKILL of
a run's last resort. One line is logged per service started (name, pid, url) and stopped. While the run goes on,
a watcher logs a warning with the log tail when a service exits on its own.

Not done here: restarting a service that died; the run keeps going and its sessions see the failures. Services
that leave their group (`setsid`, double forks) are not followed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from relax_pipeline.agent.launcher import RESERVED_PREFIX, _group_alive, _signal_name

log = logging.getLogger("relax_pipeline")

SERVICE_KEYS = ("command", "cwd", "env", "port", "health_url", "startup_timeout")
"""Keys one `agent.services.<name>` entry may set."""
LOG_DIR = "services"
"""Folder of the run's output dir that holds `<name>.log` per service."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_POLL_S = 0.1
_TAIL_BYTES = 4096


class ServiceFailure(RuntimeError):
    """A service exited before it was healthy, or did not answer its health URL in time."""


@dataclass(frozen=True)
class ServiceSpec:
    """One checked `agent.services.<name>` entry; connects the config to the running `Service`."""

    name: str
    """The key under `agent.services`; also the log file's name."""
    command: str
    """Shell command run by `bash -c`."""
    cwd: str | None = None
    """Working directory; None keeps the run's."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (never `RELAX_*`)."""
    port: int | None = None
    """The port it listens on (informational; the health URL and agent.env interpolate it)."""
    health_url: str | None = None
    """Polled until a 2xx answer; None: ready once started."""
    startup_timeout: float = 120.0
    """Seconds the health URL may take to answer."""

    @classmethod
    def parse(cls, name: str, raw: Mapping[str, Any] | None) -> ServiceSpec:
        """Check one entry; every error names `agent.services.<name>[.<key>]` and the fix."""
        key = f"agent.services.{name}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{key}: a service name is letters, digits, '_', '-' or '.' (it names the log file)")
        if not isinstance(raw, Mapping):
            raise ValueError(f"{key} must be a mapping with keys among {list(SERVICE_KEYS)}, got {raw!r}")
        unknown = sorted(str(k) for k in raw if k not in SERVICE_KEYS)
        if unknown:
            raise ValueError(f"{key}.{unknown[0]} is not a service key; use one of {list(SERVICE_KEYS)}")
        command = raw.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError(f"{key}.command is missing; set the shell command that starts the service")
        env = _env(key, raw.get("env") or {})
        timeout = _timeout(key, raw.get("startup_timeout", 120.0))
        port = raw.get("port")
        if port is not None and not isinstance(port, int):
            raise ValueError(f"{key}.port={port!r} must be an integer or null")
        cwd = None if raw.get("cwd") is None else str(raw["cwd"])
        health = None if raw.get("health_url") is None else str(raw["health_url"])
        return cls(name, command, cwd, env, port, health, timeout)


def _env(key: str, env: Any) -> dict[str, str]:
    """The entry's env as strings; the RELAX_ prefix is refused."""
    if not isinstance(env, Mapping):
        raise ValueError(f"{key}.env must be a mapping of variable names to values, got {env!r}")
    reserved = sorted(str(k) for k in env if str(k).startswith(RESERVED_PREFIX))
    if reserved:
        raise ValueError(f"{key}.env.{reserved[0]}: the RELAX_ prefix is reserved; rename the variable")
    return {str(k): str(v) for k, v in env.items()}


def _timeout(key: str, value: Any) -> float:
    """A positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{key}.startup_timeout={value!r} must be a positive number of seconds")
    return float(value)


def parse_services(services: Mapping[str, Any] | None) -> list[ServiceSpec]:
    """Every entry of `agent.services`, checked, in config order."""
    return [ServiceSpec.parse(name, raw) for name, raw in (services or {}).items()]


def service_problems(services: Mapping[str, Any] | None) -> list[str]:
    """What job=check reports: a bad entry, or a `cwd` that is not a directory. Starts nothing."""
    try:
        specs = parse_services(services)
    except ValueError as error:
        return [str(error)]
    return [f"agent.services.{s.name}.cwd={s.cwd!r} is not a directory"
            for s in specs if s.cwd is not None and not Path(s.cwd).is_dir()]


class Service:
    """One running service: its process group, its log and its health check."""

    def __init__(self, spec: ServiceSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False

    @property
    def pid(self) -> int | None:
        """Pid (and process group id) of the service's shell, None before start."""
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        """Launch `bash -c command` in its own process group, logging to `log_path`."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(RESERVED_PREFIX)}
        env.update(self.spec.env)
        with open(self.log_path, "ab") as out:
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    "bash", "-c", self.spec.command, cwd=self.spec.cwd, env=env, start_new_session=True,
                    stdin=subprocess.DEVNULL, stdout=out.fileno(), stderr=subprocess.STDOUT)
            except OSError as error:
                raise self.failure(f"could not start ({error}); check its cwd and command") from error

    async def wait_healthy(self, client: httpx.AsyncClient) -> None:
        """Return once `health_url` answers 2xx; raise `ServiceFailure` on an early exit or the timeout."""
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout
        while True:
            if self.proc.returncode is not None:
                raise self.failure(f"exited with {_exit_text(self.proc.returncode)} before it was healthy")
            if self.spec.health_url is None or await _answers(client, self.spec.health_url):
                return
            if time.monotonic() >= deadline:
                raise self.failure(f"did not answer {self.spec.health_url} with a 2xx within "
                                   f"startup_timeout={self.spec.startup_timeout:g} s")
            await asyncio.sleep(_POLL_S)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the group, wait up to `grace_s` for it to empty, SIGKILL it, reap the shell; idempotent."""
        if self.proc is None:
            return
        self.stopping = True
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._signal(signal.SIGKILL)
        await self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the group without waiting."""
        if self.proc is not None:
            self.stopping = True
            self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self) -> str:
        """The end of the service's log, decoded with replacement characters."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")

    def failure(self, reason: str) -> ServiceFailure:
        """A `ServiceFailure` naming the service, the reason, the log's last line and path (first line: the run's
        one-sentence failure), then the log tail."""
        tail = self.tail()
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "(empty)")
        return ServiceFailure(f"agent.services.{self.spec.name} {reason}; its log ends: {last} (full log: "
                              f"{self.log_path})\nlast output:\n{tail}")


class Services:
    """The run's services: started once, health-checked, watched, stopped at the end."""

    def __init__(self, services: Mapping[str, Any] | None, output_dir: str | Path, grace_s: float = 5.0) -> None:
        self.specs = parse_services(services)
        self.log_dir = Path(output_dir) / LOG_DIR
        self.grace_s = grace_s
        self.running: list[Service] = []
        self._watchers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every service in order and wait until each is healthy; on a failure stop all and raise."""
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            for spec in self.specs:
                service = Service(spec, self.log_dir / f"{spec.name}.log")
                try:
                    await service.start()
                    self.running.append(service)
                    await service.wait_healthy(client)
                except BaseException:
                    await self.stop()
                    raise
                log.info("service %s started: pid=%s url=%s log=%s", spec.name, service.pid,
                         spec.health_url or "-", service.log_path)
                self._watchers.append(asyncio.ensure_future(self._watch(service)))

    async def _watch(self, service: Service) -> None:
        """Warn, with the log tail, when a service exits while the run still needs it."""
        assert service.proc is not None
        code = await service.proc.wait()
        if not service.stopping:
            log.warning("%s", service.failure(f"exited with {_exit_text(code)} while the run goes on"))

    async def stop(self) -> None:
        """Stop every started service, last started first; idempotent."""
        for task in self._watchers:
            task.cancel()
        self._watchers.clear()
        while self.running:
            service = self.running.pop()
            await service.stop(self.grace_s)
            assert service.proc is not None
            log.info("service %s stopped: pid=%s %s", service.spec.name, service.pid,
                     _exit_text(service.proc.returncode))

    def kill(self) -> None:
        """SIGKILL every started service at once (a second Ctrl-C)."""
        for service in self.running:
            service.kill()

    async def __aenter__(self) -> Services:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    """True when GET `url` answers 2xx; a refused or timed-out connection is False."""
    try:
        return (await client.get(url)).is_success
    except httpx.HTTPError:
        return False


def _exit_text(code: int | None) -> str:
    """`exit code 3` or `signal SIGTERM`."""
    if code is None:
        return "no exit code"
    return f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
