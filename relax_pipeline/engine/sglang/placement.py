"""`engine.placement=ray`: the SGLang servers of `engine.launch=true` placed on a Ray cluster by a placement group.

`RayServers.start` joins the run's Ray cluster (`infra/ray_runtime.connect`, `ray.*` keys), reserves one placement
group of `engine.servers` bundles, each `{GPU: engine.gpus_per_server, CPU: engine.cpus_per_server}` (a CPU-only
bundle when `gpus_per_server` is 0), with `engine.placement_strategy` (`PACK` by default; `SPREAD`,
`STRICT_PACK`, `STRICT_SPREAD`), and starts one `ServerHost` actor in each bundle. Ray gives the actor its GPUs
(`CUDA_VISIBLE_DEVICES`); the actor starts `<engine.launch_command> --model-path M --host IP --port P
<engine.server_args>` on its node (`sglang.launch.server_command`), bound to the node's cluster address on a free
port, and answers the URL. The engine then polls each URL's `/health` (a server that exits first fails the start
with its command and log tail) and uses the URLs as it uses launched ones; the router (`engine.router=smg`)
gets them as `--worker-urls`. `stop` ends every server (SIGTERM, grace, SIGKILL on its node), copies each log
into `<engine.log_dir>/server_<i>.log`, kills the actors and removes the placement group.

A placement group that cannot be reserved within `engine.launch_timeout` (not enough GPUs or CPUs in the cluster)
fails the start naming the bundles and the cluster's resources. `model.path` and `engine.weights_dir` must be
paths every node can read (a shared file system), as for any launched server.

Not done here: one server spanning several nodes (multi-node tensor parallelism), restarting a lost server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from relax_pipeline.engine.sglang.launch import GRACE_S, server_command
from relax_pipeline.infra import ray_runtime
from relax_pipeline.infra.ports import free_port
from relax_pipeline.infra.processes import die_with_parent, signal_group

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Placement group strategies Ray offers (`engine.placement_strategy`)."""
LOG_LIMIT = 1 << 20
"""Most bytes of a server's log copied back at stop."""


class ServerHost:
    """Runs one SGLang server on its node, inside its placement group bundle (see the module)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkdtemp(prefix=f"relax-sglang-{name}-")) / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.command = ""

    def start(self, launch_command: str, model_path: str, server_args: Mapping[str, Any]) -> str:
        """Start the server on this node's address and a free port; its URL."""
        host = ray_runtime.node_ip()
        port = free_port(host)
        self.command = server_command(launch_command, model_path, host, port, server_args)
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(["bash", "-c", self.command], stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=die_with_parent)
        return f"http://{host}:{port}"

    def poll(self) -> int | None:
        """The server's exit code, None while it runs."""
        return self.process.poll() if self.process is not None else None

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        return "\n".join(self._log().splitlines()[-lines:])

    def stop(self, grace_s: float = GRACE_S) -> str:
        """End the server's process group (SIGTERM, grace, SIGKILL); its log (the last `LOG_LIMIT` bytes)."""
        if self.process is not None and self.process.poll() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self._log()

    def _log(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_LIMIT))
                return log.read().decode("utf-8", errors="replace")
        except OSError:
            return "(no log)"


class RayServers:
    """The servers one engine placed on Ray; `start` them, `stop` them (see the module)."""

    def __init__(self, log_dir: Path, ray: Mapping[str, Any] | None, strategy: str = "PACK",
                 cpus_per_server: float = 1.0) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"engine.placement_strategy={strategy!r}; choose one of {list(STRATEGIES)}")
        self.log_dir = log_dir
        self.ray_settings = dict(ray or {})
        self.strategy = strategy
        self.cpus_per_server = cpus_per_server
        self.hosts: list[Any] = []
        self.group: Any = None

    async def start(self, count: int, gpus_per_server: int, launch_command: str, model_path: str,
                    server_args: Mapping[str, Any], timeout: float) -> list[str]:
        """Reserve the bundles, start a server in each, wait until each answers /health; their URLs."""
        ray = ray_runtime.connect(self.ray_settings)
        self.group = await self._reserve(ray, count, gpus_per_server, timeout)
        self.hosts = [self._host(ray, i, gpus_per_server) for i in range(count)]
        urls = await asyncio.gather(*(h.start.remote(launch_command, model_path, dict(server_args))
                                      for h in self.hosts))
        await asyncio.gather(*(self._wait_ready(h, i, url, timeout) for i, (h, url) in enumerate(zip(
            self.hosts, urls, strict=True))))
        return list(urls)

    async def _reserve(self, ray: Any, count: int, gpus: int, timeout: float) -> Any:
        from ray.util.placement_group import placement_group

        bundle = {"CPU": self.cpus_per_server, **({"GPU": gpus} if gpus > 0 else {})}
        group = placement_group([dict(bundle) for _ in range(count)], strategy=self.strategy)
        try:
            await asyncio.wait_for(group.ready(), timeout)
        except TimeoutError:
            ray.util.remove_placement_group(group)
            raise RuntimeError(f"engine.placement=ray: the Ray cluster could not reserve {count} x {bundle} "
                               f"({self.strategy}) within {timeout:.0f} s (engine.launch_timeout); cluster "
                               f"resources: {ray.cluster_resources()}; lower engine.servers, engine.gpus_per_server "
                               "or engine.cpus_per_server, or add nodes") from None
        return group

    def _host(self, ray: Any, index: int, gpus: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return ray.remote(ServerHost).options(num_cpus=self.cpus_per_server, num_gpus=gpus, max_restarts=0,
                                              scheduling_strategy=strategy).remote(f"server_{index}")

    async def _wait_ready(self, host: Any, index: int, url: str, timeout: float) -> None:
        """Poll `url/health` until 2xx; fail naming the server, its command and log if it exits or times out."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while True:
                code = await host.poll.remote()
                if code is not None:
                    raise RuntimeError(f"server_{index} on Ray ({url}) exited with code {code} during start-up:\n"
                                       f"{await host.tail.remote()}")
                try:
                    if (await client.get(url + "/health")).is_success:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server_{index} on Ray did not answer {url}/health within {timeout:.0f} s "
                                       f"(engine.launch_timeout):\n{await host.tail.remote()}")
                await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """End every server, copy its log to `log_dir`, kill the actors, remove the placement group."""
        if not self.hosts and self.group is None:
            return
        ray = ray_runtime.import_ray()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for index, host in enumerate(self.hosts):
            try:
                text = await host.stop.remote()
                (self.log_dir / f"server_{index}.log").write_text(text)
            except ray.exceptions.RayError as error:
                (self.log_dir / f"server_{index}.log").write_text(f"(server lost: {error})\n")
            ray.kill(host)
        self.hosts = []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
