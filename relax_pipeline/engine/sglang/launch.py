"""Start and stop the processes `engine=sglang` owns: SGLang servers (`engine.launch=true`) and smg.

`Processes` starts each command with `bash -c` in its own process group, its stdout and stderr in a log file
of the run's output folder (`sglang/server_<i>.log`, `sglang/router.log`), polls a readiness URL until it
answers 2xx and stops everything at the end (SIGTERM to the group, a grace period, SIGKILL). A process that
exits during start-up, or a URL that stays silent past the timeout, fails the start with the command, the
URL and the log's last lines.

Commands: a server is `<engine.launch_command> --model-path M --host H --port P <engine.server_args>`, one
per GPU group (`CUDA_VISIBLE_DEVICES` set to consecutive `engine.gpus_per_server` devices; 0 leaves it
alone); the router is `<engine.router_command> --host H --port P --worker-urls U... --policy manual
--assignment-mode min_load <engine.router_args>` (sticky routing keys: see `sglang/routing.py`). Dict
arguments become flags: `{mem_fraction_static: 0.8, enable_metrics: true}` →
`--mem-fraction-static 0.8 --enable-metrics`; false and null are left out; lists repeat their values.

Not done here: remote launches (start servers elsewhere and pass `engine.urls`), restarts of a crashed server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from relax_pipeline.infra.ports import free_port
from relax_pipeline.infra.processes import signal_group

log = logging.getLogger(__name__)
GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when stopping a launched process."""


def flags(args: Mapping[str, Any]) -> list[str]:
    """Command-line flags of `args` (see the module)."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def server_command(launch_command: str, model_path: str, host: str, port: int, args: Mapping[str, Any]) -> str:
    """The shell command of one SGLang server."""
    tail = ["--model-path", model_path, "--host", host, "--port", str(port), *flags(args)]
    return f"{launch_command} {shlex.join(tail)}"


def router_command(command: str, host: str, port: int, workers: Sequence[str], args: Mapping[str, Any]) -> str:
    """The shell command of smg in front of `workers`, sticky by routing key."""
    merged = {"policy": "manual", "assignment_mode": "min_load", **args}
    tail = ["--host", host, "--port", str(port), "--worker-urls", *workers, *flags(merged)]
    return f"{command} {shlex.join(tail)}"


def gpu_env(index: int, gpus_per_server: int) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` of server `index` (consecutive devices); empty when `gpus_per_server` is 0."""
    if gpus_per_server <= 0:
        return {}
    first = index * gpus_per_server
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in range(first, first + gpus_per_server))}


@dataclass
class Launched:
    """One process started by `Processes`."""

    name: str
    command: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class Processes:
    """The servers and router this engine launched (see the module)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.launched: list[Launched] = []

    def start(self, name: str, command: str, env: Mapping[str, str] | None = None) -> Launched:
        """Start `command` (bash -c, own process group), output to `<log_dir>/<name>.log`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as out:
            process = subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, **(env or {})}, start_new_session=True)
        launched = Launched(name, command, process, log_path)
        self.launched.append(launched)
        log.info("sglang: started %s (pid %d): %s; log %s", name, process.pid, command, log_path)
        return launched

    async def wait_ready(self, launched: Launched, url: str, timeout: float) -> None:
        """Poll `url` until it answers 2xx; fail naming the process and its log if it exits or times out."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                if launched.process.poll() is not None:
                    raise RuntimeError(f"{launched.name} exited with code {launched.process.returncode} during "
                                       f"start-up: {launched.command}\nlog {launched.log_path}:\n{launched.tail()}")
                if await _answers(client, url):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{launched.name} did not answer {url} within {timeout:.0f} s "
                                       f"(engine.launch_timeout): {launched.command}\nlog {launched.log_path}:\n"
                                       f"{launched.tail()}")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """SIGTERM every process group, wait up to `GRACE_S`, then SIGKILL what is left."""
        for launched in reversed(self.launched):
            signal_group(launched.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for launched in reversed(self.launched):
            while launched.process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if launched.process.poll() is None:
                signal_group(launched.process.pid, signal.SIGKILL)
                await asyncio.to_thread(launched.process.wait)
        self.launched.clear()


async def launch_servers(processes: Processes, launch: Any, model_path: str) -> list[str]:
    """Start `launch.servers` SGLang servers (`SglangEngineSettings.launch_part`) on free ports of `launch.host`,
    one per GPU group; their URLs, once each answers /health."""
    started = []
    for i in range(launch.servers):
        port = free_port(launch.host)
        command = server_command(launch.command, model_path, launch.host, port, launch.server_args)
        started.append((processes.start(f"server_{i}", command, gpu_env(i, launch.gpus_per_server)),
                        f"http://{launch.host}:{port}"))
    await asyncio.gather(*(processes.wait_ready(p, url + "/health", launch.timeout) for p, url in started))
    return [url for _, url in started]


async def workers_healthy(get: Callable[[str], Awaitable[Any]], count: int, timeout: float) -> bool:
    """Whether a router's `GET /workers` (`get(path)`) lists `count` healthy workers within `timeout` seconds."""
    for _ in range(int(timeout * 5)):
        workers = (await get("/workers")).get("workers", [])
        if len(workers) == count and all(w.get("is_healthy") for w in workers):
            return True
        await asyncio.sleep(0.2)
    return False


async def _answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url)).is_success
    except httpx.HTTPError:
        return False
