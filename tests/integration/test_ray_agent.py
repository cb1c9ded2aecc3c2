"""`agent.executor=ray` below a run: `RayAgent` sessions on the nodes of a local Ray cluster
(`relax_pipeline.testing.ray_cluster`), checked on the processes themselves: an agent that overruns
`agent.timeout` has its whole process group ended on the node (SIGTERM ignored: SIGKILL after the grace) and
fails as a timeout naming the node; a dropped session is ended the same way; a cancel that reaches the node
before the call starts nothing; when the runner dies its session fails as lost and the agent is gone; the death
signal (`setpriv --pdeathsig`, else `prctl` in the child) kills the main process when the thread that started it
exits; by default a node keeps session files in memory (/dev/shm) and the start line says where, naming the key.
Each agent writes its pids into the test's folder (the nodes share this machine). Skipped, naming the extra,
without Ray."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.agent import ray_node
from relax_pipeline.agent.launcher import AgentFailure, AgentSpec
from relax_pipeline.agent.ray_executor import RayAgent, folders_note, runner_pool, warm_up
from relax_pipeline.agent.ray_node import MEMORY_MIN_FREE, NodeCall, memory_backed, session_root
from relax_pipeline.infra import ray_runtime
from relax_pipeline.testing.ray_cluster import joined_cluster

pytestmark = pytest.mark.asyncio

STUBBORN = "trap '' TERM; sleep 300 & echo $! > {pids}/child; echo $$ > {pids}/main; wait"
"""A group that ignores SIGTERM (bash and, inherited, its child): only the SIGKILL after the grace ends it."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with joined_cluster(workers=1, cpus=2, head_cpus=1) as cluster:
        yield cluster


@pytest.fixture
def ray_pool(cluster: Any) -> Iterator[None]:
    """Each test gets fresh runners (its own event loop); they are ended after it."""
    yield
    ray_runtime.shutdown()


def spec(command: str, **kwargs: Any) -> AgentSpec:
    return AgentSpec(command=command, executor="ray", grace_s=1.0, **kwargs)


async def started(tmp_path: Path, agent_spec: AgentSpec, session_id: str = "s-1") -> RayAgent:
    io_dir = tmp_path / "io"
    io_dir.mkdir(exist_ok=True)
    (io_dir / "input.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    agent = RayAgent(agent_spec)
    await agent.start({"RELAX_INPUT_JSON": str(io_dir / "input.json"), "RELAX_OUTPUT_JSON": str(io_dir / "out.json"),
                       "RELAX_SESSION_IO_DIR": str(io_dir), "RELAX_SESSION_ID": session_id}, io_dir)
    return agent


async def pids_of(folder: Path, names: tuple[str, ...] = ("main", "child")) -> list[int]:
    """The pids the agent wrote, once it wrote them all."""
    deadline = time.monotonic() + 60
    while not all((folder / n).exists() and (folder / n).read_text().strip() for n in names):
        assert time.monotonic() < deadline, f"the agent never wrote {names} into {folder}"
        await asyncio.sleep(0.05)
    return [int((folder / n).read_text()) for n in names]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


async def gone(pids: list[int]) -> bool:
    """Whether every pid is gone within a few seconds (a SIGKILLed child may wait for its reaper)."""
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return not any(alive(p) for p in pids)


async def test_an_agent_over_its_timeout_has_its_group_ended_on_the_node(tmp_path: Path, ray_pool: None) -> None:
    agent = await started(tmp_path, spec(STUBBORN.format(pids=tmp_path), timeout=2.0))
    pids = await pids_of(tmp_path)
    assert all(alive(p) for p in pids)
    with pytest.raises(AgentFailure) as failure:
        await agent.wait()
    assert failure.value.reason.startswith("timed out after 2 s of active time (its process group on node ")
    assert await gone(pids), "the main process and its child, both ignoring SIGTERM, were SIGKILLed"
    assert "ray: session s-1 runs on node " in failure.value.log_tail


async def test_a_dropped_session_has_its_group_ended_on_the_node(tmp_path: Path, ray_pool: None) -> None:
    agent = await started(tmp_path, spec(STUBBORN.format(pids=tmp_path), timeout=300.0))
    pids = await pids_of(tmp_path)
    waiter = asyncio.create_task(agent.wait())
    await asyncio.sleep(0.2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await gone(pids)


async def test_a_cancel_that_arrives_first_starts_nothing(tmp_path: Path, ray_pool: None) -> None:
    pool = runner_pool(spec("unused"))
    runner = await pool.acquire()
    assert await runner.actor.cancel.remote("s-early") is False, "nothing runs yet"
    call = NodeCall("s-early", f"touch {tmp_path}/ran", None, {}, {"RELAX_SESSION_ID": "s-early"}, "{}")
    answer = await runner.actor.run.remote(call)
    assert answer.reason == "cancelled before it started" and answer.exit_code is None
    assert "spawned" not in answer.marks and not (tmp_path / "ran").exists()
    again = await runner.actor.run.remote(call)
    assert again.reason is None and again.exit_code == 0 and (tmp_path / "ran").exists(), "the cancel was used up"
    pool.release(runner)


async def test_the_agent_dies_with_its_runner_and_the_session_fails_as_lost(tmp_path: Path, ray_pool: None) -> None:
    import ray

    agent = await started(tmp_path, spec(f"echo $$ > {tmp_path}/main; exec sleep 300", timeout=300.0))
    [main] = await pids_of(tmp_path, ("main",))
    assert agent._runner is not None
    ray.kill(agent._runner.actor)
    with pytest.raises(AgentFailure) as failure:
        await agent.wait()
    # Either the runner died first (the call is lost) or, racing its own death, it still saw the agent killed and
    # answered that: both fail the session naming the node, and nothing is left running.
    reason = failure.value.reason
    assert "was lost while the agent ran" in reason or reason.startswith("killed by signal SIGKILL on node"), reason
    assert await gone([main]), "the main process got its death signal when the runner's worker died"


async def test_a_session_answers_with_the_node_timing(tmp_path: Path, ray_pool: None) -> None:
    agent = await started(tmp_path, spec(f'cat "$RELAX_INPUT_JSON" > "$RELAX_OUTPUT_JSON"; echo $$ > {tmp_path}/main',
                                         timeout=60.0))
    exit_ = await agent.wait()
    assert exit_.exit_code == 0 and json.loads((tmp_path / "io" / "out.json").read_text())["messages"]
    log = (tmp_path / "io" / "agent.log").read_text()
    timing = next(line for line in log.splitlines() if line.startswith("ray: timing ms: "))
    for phase in ("queued", "submit", "call to node", "spawn", "agent", "wrap-up", "answer back"):
        assert f"{phase} " in timing
    assert not alive(int((tmp_path / "main").read_text()))


async def test_the_main_process_dies_with_the_thread_that_started_it(tmp_path: Path) -> None:
    """The death signal itself, without Ray (whose raylet also ends a dead worker's direct children)."""
    from relax_pipeline.agent.ray_node import NodeProcess
    from relax_pipeline.infra.processes import DEATH_WRAPPER, death_wrapper

    if Path("/usr/bin/setpriv").exists():
        assert death_wrapper() == DEATH_WRAPPER, "util-linux's setpriv is here: the fast path is taken"
    process = NodeProcess(AgentSpec(command=f"echo $$ > {tmp_path}/main; exec sleep 300"))

    async def start_and_see_it_run() -> None:  # the thread lives until the agent runs, then exits
        await process.start({}, tmp_path / "io")
        await pids_of(tmp_path, ("main",))

    starter = threading.Thread(target=lambda: asyncio.run(start_and_see_it_run()))
    starter.start()
    starter.join()
    [main] = await pids_of(tmp_path, ("main",))
    try:
        assert await gone([main]), "the thread that started it exited: SIGKILL"
    finally:
        process.kill()


async def test_sessions_live_under_the_node_tmpdir(tmp_path: Path, ray_pool: None) -> None:
    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    agent = await started(tmp_path, spec(f'echo "$RELAX_SESSION_IO_DIR" > {tmp_path}/where', timeout=60.0,
                                         ray={"node_tmpdir": str(node_tmp)}))
    await agent.wait()
    where = Path((tmp_path / "where").read_text().strip())
    assert where.parent == node_tmp and where.name.startswith("relax-s-1-")
    deadline = time.monotonic() + 10
    while where.exists() and time.monotonic() < deadline:  # on a disk the node removes it in a thread, after answering
        await asyncio.sleep(0.05)
    assert not where.exists(), "the session's folder is removed once it ended"


SHM = "/dev/shm"
HAS_SHM = memory_backed(SHM) and shutil.disk_usage(SHM).free >= MEMORY_MIN_FREE


@pytest.mark.skipif(not HAS_SHM, reason=f"this machine has no memory-backed {SHM} with room")
async def test_by_default_sessions_live_in_memory_and_the_start_line_says_so(
        tmp_path: Path, ray_pool: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="relax_pipeline")
    await warm_up(spec("unused"))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ray: session files")]
    assert f"under {SHM} (in memory, the default) on 2 nodes; set ray.node_tmpdir" in line, line
    agent = await started(tmp_path, spec(f'echo "$RELAX_SESSION_IO_DIR" > {tmp_path}/where', timeout=60.0))
    await agent.wait()
    where = Path((tmp_path / "where").read_text().strip())
    assert where.parent == Path(SHM) and where.name.startswith("relax-s-1-") and not where.exists()


async def test_without_memory_the_node_takes_its_temp_folder_and_says_it_is_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose /dev/shm is missing, on disk or too small falls back to its temp folder; the line advises."""
    on_disk = tmp_path if not memory_backed(str(tmp_path)) else Path("/nonexistent/shm")
    monkeypatch.setattr(ray_node, "MEMORY_FOLDER", str(on_disk))
    folder = session_root(None, "n1")
    assert folder.path == tempfile.gettempdir() and not folder.configured
    if not folder.memory:
        assert "on disk, the default) on 1 node; each session start pays its file creates on disk: a memory-backed " \
               "ray.node_tmpdir (/dev/shm) avoids it" in folders_note([folder])
    if HAS_SHM:
        monkeypatch.setattr(ray_node, "MEMORY_FOLDER", SHM)
        monkeypatch.setattr(ray_node, "MEMORY_MIN_FREE", shutil.disk_usage(SHM).free * 2)
        assert session_root(None, "n1").path != SHM, "too little room in memory: the temp folder"


async def test_a_node_tmpdir_missing_on_the_nodes_fails_at_start_naming_the_key(ray_pool: None) -> None:
    pool = runner_pool(spec("unused", ray={"node_tmpdir": "/nonexistent/relax"}))
    with pytest.raises(Exception, match=r"ray\.node_tmpdir='/nonexistent/relax' is not a writable folder on node"):
        await pool.ready()


async def test_sessions_started_together_each_get_their_own_answer(tmp_path: Path, ray_pool: None) -> None:
    """Sessions started in one go travel to a node in one call (`RunnerPool.submit`) and their answers stream back
    as they end, here in the reverse order; each session gets its own exit code, output and log."""
    agents = []
    for i in range(12):
        io_dir = tmp_path / f"io-{i}"
        io_dir.mkdir()
        (io_dir / "input.json").write_text(json.dumps({"i": i}))
        agent = RayAgent(spec(f'sleep 0.{11 - i}; echo "agent {i}"; cat "$RELAX_INPUT_JSON" > "$RELAX_OUTPUT_JSON"; '
                              f"exit {3 if i % 4 == 0 else 0}", timeout=60.0))
        await agent.start({"RELAX_INPUT_JSON": str(io_dir / "input.json"), "RELAX_OUTPUT_JSON": str(io_dir / "out"),
                           "RELAX_SESSION_ID": f"s-{i}"}, io_dir)
        agents.append(agent)
    results = await asyncio.gather(*(agent.wait() for agent in agents), return_exceptions=True)
    for i, result in enumerate(results):
        assert json.loads((tmp_path / f"io-{i}" / "out").read_text()) == {"i": i}
        assert f"agent {i}\n" in (tmp_path / f"io-{i}" / "agent.log").read_text()
        if i % 4 == 0:
            assert isinstance(result, AgentFailure) and result.exit_code == 3, result
        else:
            assert not isinstance(result, BaseException) and result.exit_code == 0, result
