"""`agent.executor=ray`: each session's agent runs on a node of a Ray cluster, waited on like a local process.

The agent contract is unchanged (docs/design.md §3.2): `RayAgent.start` reads the session's input file here and sends
its text, `agent.command`, `agent.cwd`, `agent.env` and the session's `RELAX_*` variables as one `NodeCall` to
the `NodeRunner` actor of a node (`agent/ray_node.py`), which writes the input into a temporary folder on that
node, runs `bash -c command` there in its own process group and answers the exit code, the output file's text
and the log tail. Here the output text becomes the session's local `RELAX_OUTPUT_JSON` and the log its local
`agent.log` (with a first line naming the node), so output parsing, reward and dump are the same as for local
agents. No disk is shared. `RELAX_BASE_URL` must be reachable from the nodes: `gateway.public_url` on a real
cluster; 127.0.0.1 works on a local one.

Budget and cancellation: the driver keeps the session's `ActiveTimer` (the group lease pauses and resumes it) and
waits with `wait_active`, as for local agents. When the budget runs out, or the session is dropped, `terminate`
asks the node's runner to end the process group (SIGTERM, `agent.grace_s`, SIGKILL, on the node) and waits for
its answer. `kill` (the run's second Ctrl-C) sends the node a SIGKILL without waiting.

Placement (`RunnerPool`): Ray places one runner actor on every alive node (node affinity, no CPU held by the
actor) and carries the calls; a session goes to the runner with the most room for `agent.resources` (a node's
Ray resources divided by what one session holds: `{num_cpus: 1}` runs at most as many sessions as the node has
CPUs; a node without a resource named there takes none). The runners start when the run does (`warm_up`, while
the model loads), not on the first session. When every node is full the session waits here, its active time
counting. Sessions started in one turn of the driver's loop go to a node together, one Ray call per node
(`RunnerPool.submit`, at most `BATCH_MAX` a call), their answers streamed back as they end (in one item when they
end together). Nodes that join are picked up within a second (the node list is read in a thread: Ray's `nodes()`
blocks, and the driver's loop also serves the gateway).

Timing: each session's agent.log gets one `ray: timing ms:` line (before the node's log), the milliseconds of each
phase of its life (`timing_note`): queued here (for the driver's loop, for a node with room), submitting the call,
the call reaching the node, the spawn, the agent, the wrap-up on the node and the answer coming back; driver and
node marks (one clock on a local cluster).

Node loss: when the node (or its runner) dies while a session runs, the session fails with a reason naming the
node (`AgentFailure`, recorded in the dump like any failed session) and the run goes on on the other nodes.

Not done here: restarting a session on another node (a session is not idempotent), shipping `agent.cwd` to the
nodes (use `ray.runtime_env` or a shared install), streaming the log while the agent runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_pipeline.agent.launcher import AgentFailure, AgentSpec
from relax_pipeline.agent.ray_node import NodeAnswer, NodeCall, NodeFolder, NodeRunner
from relax_pipeline.agent.remote import RemoteAgent
from relax_pipeline.infra import ray_runtime

log = logging.getLogger("relax_pipeline")

NODE_PATHS = ("RELAX_INPUT_JSON", "RELAX_OUTPUT_JSON", "RELAX_SESSION_IO_DIR")
"""Session variables that are paths on the node; the runner sets them."""
RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
"""`agent.resources` keys that name Ray's built-in resources; any other key is a custom resource."""
REFRESH_S = 1.0
"""How often the pool looks for nodes that joined or left."""
CANCEL_MARGIN_S = 10.0
"""Seconds past the grace period a node's runner may take to end a cancelled session."""
BATCH_MAX = 8
"""Most sessions sent to one node in one Ray call (`RunnerPool.submit`): a batch's first session waits for the
rest to be started, so a small batch keeps that wait short while still sharing one call's cost among eight."""


@dataclass
class Runner:
    """The runner actor of one node and the sessions it runs now."""

    node_id: str
    """Ray's node id."""
    name: str
    """`ip (node id prefix)`, as failures name the node."""
    actor: Any
    """The `NodeRunner` actor handle."""
    capacity: float
    """Sessions it may run at once for the run's `agent.resources` (inf: no limit)."""
    in_flight: int = 0
    """Sessions sent to it and not answered yet."""
    batch: list[tuple[NodeCall, asyncio.Future[NodeAnswer]]] = field(default_factory=list)
    """Sessions given to it and not sent yet (`RunnerPool.submit`)."""


class RunnerPool:
    """One `NodeRunner` per alive node of the cluster; picks the one with the most room (see the module)."""

    def __init__(self, ray: Any, resources: Mapping[str, float], tmpdir: str | None = None) -> None:
        self.ray = ray
        self.resources = dict(resources)
        self.tmpdir = tmpdir
        """`ray.node_tmpdir`: where each node's runner puts session folders (None: the node's choice,
        `ray_node.session_root`)."""
        self.runners: dict[str, Runner] = {}
        self._freed = asyncio.Event()
        self._refreshed = -math.inf
        self._reading: asyncio.Future[list[dict[str, Any]]] | None = None
        self._remote = ray.remote(NodeRunner)
        self._deliveries: set[asyncio.Future[None]] = set()

    async def acquire(self) -> Runner:
        """The runner with the most room; waits while every node is full."""
        while True:
            await self._refresh()
            if not any(r.capacity > 0 for r in self.runners.values()):
                raise AgentFailure(f"no node of the Ray cluster has agent.resources={self.resources} (nodes: "
                                   f"{self._describe()}); lower agent.resources or add nodes", None, "")
            if (runner := self.try_acquire()) is not None:
                return runner
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), REFRESH_S)
            except TimeoutError:
                pass

    def try_acquire(self) -> Runner | None:
        """The runner with the most room, None while every node is full (or none is known yet)."""
        free = [r for r in self.runners.values() if r.in_flight < r.capacity]
        if not free:
            return None
        runner = min(free, key=lambda r: (r.in_flight / r.capacity if r.capacity < math.inf else r.in_flight))
        runner.in_flight += 1
        return runner

    def submit(self, runner: Runner, call: NodeCall) -> asyncio.Future[NodeAnswer]:
        """`call`'s answer from `runner`. Sessions submitted in one turn of the loop travel together, as one Ray
        call per node (`NodeRunner.run_many`, answers streamed back as the sessions end): a Ray call costs about
        a millisecond of CPU on the driver and on the node, which 256 sessions started at once would pay one
        after another. A batch goes when it holds `BATCH_MAX` sessions or when the loop next runs."""
        answer: asyncio.Future[NodeAnswer] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(lambda _: self.release(runner))
        runner.batch.append((call, answer))
        if len(runner.batch) >= BATCH_MAX:
            self._send(runner)
        elif len(runner.batch) == 1:
            asyncio.get_running_loop().call_soon(self._send, runner)
        return answer

    def _send(self, runner: Runner) -> None:
        batch, runner.batch = runner.batch, []
        if batch:
            stream = runner.actor.run_many.options(num_returns="streaming").remote([call for call, _ in batch])
            delivery = asyncio.ensure_future(_deliver(stream, {call.session_id: answer for call, answer in batch}))
            self._deliveries.add(delivery)
            delivery.add_done_callback(self._deliveries.discard)

    async def ready(self) -> None:
        """Start a runner on every alive node now and wait until each answers: a runner is a Ray worker process
        (about a second to start), which the first sessions would otherwise wait for."""
        await self._refresh()
        if self._reading is not None:
            await asyncio.wait({self._reading})
        folders = await asyncio.gather(*(runner.actor.ping.remote() for runner in self.runners.values()))
        log.info(folders_note(folders))

    def release(self, runner: Runner) -> None:
        """A session given to `runner` is done (answered, failed or cancelled)."""
        runner.in_flight -= 1
        self._freed.set()

    def lost(self, runner: Runner) -> None:
        """`runner`'s node (or actor) died: never pick it again."""
        if self.runners.get(runner.node_id) is runner:
            del self.runners[runner.node_id]
        self._refreshed = -math.inf

    def close(self) -> None:
        """End every runner actor (their sessions' process groups die with them)."""
        for runner in self.runners.values():
            try:
                self.ray.kill(runner.actor)
            except Exception as error:  # a runner already gone is fine
                log.debug("ray: could not kill the runner on %s: %s", runner.name, error)
        self.runners.clear()

    async def _refresh(self) -> None:
        """Add a runner for each node that joined, drop those of nodes that left. The node list is read from
        Ray's GCS (a blocking call) in a thread, off the event loop, at most once per `REFRESH_S`; only the
        first read (no runner yet) is waited for, later ones run while sessions go to the known runners."""
        if time.monotonic() - self._refreshed < REFRESH_S and self.runners:
            return
        self._refreshed = time.monotonic()
        reading = self._reading
        if reading is None or reading.done():
            reading = self._reading = asyncio.ensure_future(asyncio.to_thread(self.ray.nodes))
            reading.add_done_callback(self._apply)
        if not self.runners:
            await asyncio.wait({reading})

    def _apply(self, reading: asyncio.Future[list[dict[str, Any]]]) -> None:
        if reading.cancelled() or reading.exception() is not None:
            log.warning("ray: could not list the cluster's nodes: %r", None if reading.cancelled() else
                        reading.exception())
            return
        alive = {n["NodeID"]: n for n in reading.result() if n.get("Alive")}
        for node_id in [n for n in self.runners if n not in alive]:
            del self.runners[node_id]
        for node_id, node in alive.items():
            if node_id not in self.runners:
                self.runners[node_id] = self._start_runner(node)

    def _start_runner(self, node: Mapping[str, Any]) -> Runner:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = f"{node.get('NodeManagerAddress', '?')} ({node['NodeID'][:12]})"
        actor = self._remote.options(
            num_cpus=0, max_concurrency=100_000, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(name, self.tmpdir)
        return Runner(node["NodeID"], name, actor, session_capacity(node.get("Resources", {}), self.resources))

    def _describe(self) -> str:
        return "; ".join(r.name for r in self.runners.values()) or "none alive"


async def _deliver(stream: Any, waiting: dict[str, asyncio.Future[NodeAnswer]]) -> None:
    """Hand each answer of a `run_many` stream (lists of the answers of sessions that ended together) to its
    session; when the stream breaks (the node or its runner died), the sessions not answered yet get that error."""
    try:
        async for ref in stream:
            answers: list[NodeAnswer] = await ref
            for answer in answers:
                if (future := waiting.pop(answer.session_id, None)) is not None and not future.done():
                    future.set_result(answer)
    except Exception as error:
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
        return
    for future in waiting.values():
        if not future.done():
            future.set_exception(AgentFailure("the node's runner ended the batch without answering", None, ""))


TIMING_STEPS = (("queued", "started", "acquired"), ("submit", "acquired", "submitted"),
                ("call to node", "submitted", "received"),
                ("spawn", "received", "spawned"), ("agent", "spawned", "exited"), ("wrap-up", "exited", "answered"),
                ("answer back", "answered", "returned"))
"""The phases of a session's life that `timing_note` names, as (label, from mark, to mark)."""


def timing_note(marks: Mapping[str, float]) -> str:
    """One agent.log line with the ms each phase of the session took (driver and node marks; one clock on a local
    cluster, clock skew between hosts shows in `call to node` and `answer back`)."""
    parts = [f"{label} {1000 * (marks[b] - marks[a]):.0f}" for label, a, b in TIMING_STEPS if a in marks and b in marks]
    return "ray: timing ms: " + ", ".join(parts)


def folders_note(folders: list[NodeFolder]) -> str:
    """The start line saying where the nodes keep session files, in memory or on disk, and the key to change it."""
    places: dict[tuple[str, bool, bool], int] = {}
    for folder in folders:
        key = (folder.path, folder.memory, folder.configured)
        places[key] = places.get(key, 0) + 1
    parts = [f"{path} ({'in memory' if memory else 'on disk'}, {'ray.node_tmpdir' if configured else 'the default'}) "
             f"on {count} node{'s' if count > 1 else ''}" for (path, memory, configured), count in places.items()]
    advice = ("; set ray.node_tmpdir to use another folder" if all(memory for _, memory, _ in places)
              else "; each session start pays its file creates on disk: a memory-backed ray.node_tmpdir (/dev/shm) "
                   "avoids it")
    return "ray: session files (input, output, agent.log) live under " + ", ".join(parts) + advice


def session_capacity(node_resources: Mapping[str, float], resources: Mapping[str, float]) -> float:
    """Sessions a node with `node_resources` runs at once when each holds `resources` (inf: no limit)."""
    capacity = math.inf
    for key, amount in resources.items():
        if amount > 0:
            capacity = min(capacity, math.floor(node_resources.get(RESOURCE_NAMES.get(key, key), 0.0) / amount))
    return capacity


_pools: dict[tuple[tuple[tuple[str, float], ...], str | None], RunnerPool] = {}


def runner_pool(spec: AgentSpec) -> RunnerPool:
    """The run's pool for `spec.resources` (and `ray.node_tmpdir`), joining Ray (`ray_runtime.connect`) on first
    use."""
    key = (tuple(sorted(spec.resources.items())), spec.ray.get("node_tmpdir"))
    if key not in _pools:
        ray = ray_runtime.connect(spec.ray)
        _pools[key] = RunnerPool(ray, spec.resources, spec.ray.get("node_tmpdir"))
        ray_runtime.on_shutdown(lambda: _pools.pop(key).close())
    return _pools[key]


async def warm_up(spec: AgentSpec) -> None:
    """Join Ray and start every node's runner (`RunnerPool.ready`) before the first session; the run calls it at
    start-up, so a cluster that cannot be reached fails there and the first step does not wait for the runners."""
    await runner_pool(spec).ready()


class RayAgent(RemoteAgent):
    """One session run on a Ray node: start it, wait on it under the active timer, cancel it on the node."""

    def __init__(self, spec: AgentSpec) -> None:
        super().__init__(spec)
        self._runner: Runner | None = None
        self._pool: RunnerPool | None = None
        self._marks: dict[str, float] = {}
        """Epoch seconds here: `started`, `acquired` (a runner had room), `submitted`, `returned` (the answer)."""

    async def start(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Send the session to a node, at once when one has room (the answer comes when the agent is done)."""
        self._marks["started"] = time.time()
        self._open(session_env, io_dir)
        call = self._call(session_env)
        self._pool = pool = runner_pool(self.spec)
        runner = pool.try_acquire()
        self._launch(self._run(pool, call, None if runner is None else self._submit(pool, runner, call)))

    def _call(self, session_env: Mapping[str, str]) -> NodeCall:
        """The session as values: the input file's text, the env without the local paths."""
        text = self._input_text(session_env)
        env = {k: str(v) for k, v in session_env.items() if k not in NODE_PATHS}
        return NodeCall(self._session_id, self.spec.command, self.spec.cwd, {k: str(v) for k, v in
                        self.spec.env.items()}, env, text, self.spec.grace_s, self.spec.log_tail_bytes, self.spec.nice)

    async def _run(self, pool: RunnerPool, call: NodeCall, answer: asyncio.Future[NodeAnswer] | None) -> NodeAnswer:
        """The node's answer to `call`, sent already (`answer`) or, when None, once a node has room."""
        if answer is None:
            answer = self._submit(pool, await pool.acquire(), call)
        assert self._runner is not None
        # in a thread: the note creates agent.log, 0.1-4 ms on this machine's disk, which 256 sessions started
        # together paid one after another on the loop that also takes their answers (and serves the gateway)
        noted = asyncio.ensure_future(asyncio.to_thread(
            self._note, f"ray: session {call.session_id} runs on node {self._runner.name}"))
        try:
            return await answer
        finally:
            self._marks["returned"] = time.time()
            await asyncio.shield(noted)  # before the answer's lines, and never left running

    def _submit(self, pool: RunnerPool, runner: Runner, call: NodeCall) -> asyncio.Future[NodeAnswer]:
        """Give `call` to `runner` (its room taken by `acquire`); the room is freed when the answer is done."""
        self._marks["acquired"] = time.time()
        self._runner = runner
        answer = pool.submit(runner, call)
        self._marks["submitted"] = time.time()
        return answer

    def _answer(self, task: asyncio.Task[Any]) -> tuple[int | None, str, str, str | None]:
        """The node's answer; a call that did not answer (node lost, runner raised) is an `AgentFailure`."""
        if (error := task.exception()) is not None:
            raise self._ray_failure(error)
        answer: NodeAnswer = task.result()
        self._note(timing_note({**answer.marks, **self._marks}))
        reason = None if answer.reason is None else f"{answer.reason} on node {answer.node}"
        return answer.exit_code, answer.output or "", answer.log, reason

    def _ended(self) -> str:
        return f"its process group on node {self._node()} was ended"

    def _ray_failure(self, error: BaseException) -> AgentFailure:
        """The failure of a call that did not answer: node lost, or the runner raised."""
        if isinstance(error, AgentFailure):
            return AgentFailure(error.reason, error.exit_code, self.tail(), self._log_path)
        exceptions = ray_runtime.import_ray().exceptions
        lost = (exceptions.RayActorError, exceptions.WorkerCrashedError, exceptions.NodeDiedError)
        if isinstance(error, lost):
            if self._pool is not None and self._runner is not None:
                self._pool.lost(self._runner)
            return self._failure(f"lost: node {self._node()} was lost while the agent ran ({type(error).__name__}); "
                                 "the session is recorded failed and the run goes on", None)
        return self._failure(f"failed on node {self._node()}: the runner raised {type(error).__name__}: {error}", None)

    async def terminate(self) -> None:
        """End a session still running: the node ends its process group; idempotent, no-op once it answered."""
        task = self._task
        if task is None or task.done():
            return
        if self._runner is not None:
            await self._cancel_on_node(self._runner)
            await asyncio.wait({task}, timeout=self.spec.grace_s + CANCEL_MARGIN_S)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _cancel_on_node(self, runner: Runner) -> None:
        try:
            await asyncio.wait_for(runner.actor.cancel.remote(self._session_id),
                                   self.spec.grace_s + CANCEL_MARGIN_S)
        except Exception as error:  # the node may be gone: the session then fails as lost
            self._note(f"ray: cancelling session {self._session_id} on node {runner.name} failed: {error!r}")

    def kill(self) -> None:
        """The run's last resort: the node SIGKILLs the session's group; nothing is waited for."""
        if self._runner is not None and self._task is not None and not self._task.done():
            try:
                self._runner.actor.kill.remote(self._session_id)
            except Exception:  # the run is exiting; the runner dies with Ray anyway
                pass

    def _node(self) -> str:
        return self._runner.name if self._runner is not None else "(none yet: waiting for room)"
