"""`agent.executor=http`: `HttpAgent` against a real agent server over HTTP on 127.0.0.1 (the fake edge
`relax_pipeline.testing.agent_server`, uvicorn in a thread): what it sends, what it writes, how it fails and
when it sends DELETE."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.agent.executors import new_agent
from relax_pipeline.agent.http_executor import SESSION_VARIABLES, HttpAgent
from relax_pipeline.agent.launcher import AgentFailure, AgentProcess, AgentSpec
from relax_pipeline.testing.agent_server import FakeAgentServer, failing, hanging

pytestmark = pytest.mark.asyncio

SANDBOX = {"allow_network": False, "cpu_s": 5, "memory_mb": 512, "file_mb": 8, "max_processes": 32, "timeout": 3.0}


def session_env(io_dir: Path) -> dict[str, str]:
    return {
        "RELAX_INPUT_JSON": str(io_dir / "input.json"), "RELAX_OUTPUT_JSON": str(io_dir / "output.json"),
        "RELAX_SESSION_IO_DIR": str(io_dir), "RELAX_BASE_URL": "http://127.0.0.1:9/agentic_api/",
        "RELAX_SESSION_ID": "s-1", "RELAX_API_KEY": "s-1", "RELAX_MODEL": "relax", "RELAX_ROLLOUT_MODE": "train",
        "RELAX_GROUP_ID": "g-1",
    }


def spec(url: str, **kwargs: Any) -> AgentSpec:
    return AgentSpec(command="unused", executor="http", server_url=url, sandbox=SANDBOX, **kwargs)


async def started(tmp_path: Path, agent_spec: AgentSpec) -> HttpAgent:
    (tmp_path / "input.json").write_text(json.dumps({"messages": [{"role": "user", "content": "fix it"}],
                                                     "metadata": {"repo": "r1"}}))
    agent = HttpAgent(agent_spec)
    await agent.start(session_env(tmp_path), tmp_path)
    return agent


def answer(body: dict, cancelled: threading.Event) -> dict:
    return {"exit_code": 0, "output": json.dumps({"reward": 0.5}), "log": f"ran {body['input']['metadata']['repo']}"}


async def test_success_writes_output_and_log_and_sends_the_contract(tmp_path: Path) -> None:
    with FakeAgentServer(answer) as server:
        agent = await started(tmp_path, spec(server.url + "/", env={"TASK_SET": "demo"}, timeout=30.0))
        exit_ = await agent.wait()
    assert exit_.exit_code == 0 and agent.returncode == 0 and agent.pid is None
    assert json.loads((tmp_path / "output.json").read_text()) == {"reward": 0.5}
    assert "ran r1" in (tmp_path / "agent.log").read_text() and "ran r1" in agent.tail()
    [body] = server.received
    assert body["session_id"] == "s-1" and body["timeout"] == 30.0 and body["sandbox"] == SANDBOX
    assert body["input"]["metadata"] == {"repo": "r1"}
    assert body["env"] == {"TASK_SET": "demo", **{k: session_env(tmp_path)[k] for k in SESSION_VARIABLES}}


async def test_non_zero_exit_is_a_failure_with_the_log_tail(tmp_path: Path) -> None:
    with FakeAgentServer(failing(3, "Traceback: the agent gave up\n")) as server:
        agent = await started(tmp_path, spec(server.url))
        with pytest.raises(AgentFailure) as failure:
            await agent.wait()
    assert failure.value.exit_code == 3 and "exited with code 3 on the agent server" in str(failure.value)
    assert "the agent gave up" in failure.value.log_tail
    assert not (tmp_path / "output.json").exists() and server.deleted == []


async def test_server_error_is_a_failure_naming_the_status(tmp_path: Path) -> None:
    def broken(body: dict, cancelled: threading.Event) -> dict:
        raise RuntimeError("handler crashed")

    with FakeAgentServer(broken) as server:
        agent = await started(tmp_path, spec(server.url))
        with pytest.raises(AgentFailure, match="HTTP 500 to POST /sessions"):
            await agent.wait()


async def test_server_down_is_a_failure_naming_the_url(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    agent = await started(tmp_path, spec(url))
    with pytest.raises(AgentFailure, match="could not reach the agent server") as failure:
        await agent.wait()
    assert url in str(failure.value) and "agent.services" in str(failure.value)


async def test_timeout_sends_delete_and_fails(tmp_path: Path) -> None:
    with FakeAgentServer(hanging) as server:
        agent = await started(tmp_path, spec(server.url, timeout=0.3))
        with pytest.raises(AgentFailure, match="timed out after 0.3 s of active time") as failure:
            await agent.wait()
        assert server.deleted == ["s-1"]
    assert "DELETE" in failure.value.log_tail and "HTTP 200" in failure.value.log_tail


async def test_paused_time_does_not_count(tmp_path: Path) -> None:
    release = threading.Event()

    def slow(body: dict, cancelled: threading.Event) -> dict:
        release.wait(10.0)
        return answer(body, cancelled)

    with FakeAgentServer(slow) as server:
        agent = await started(tmp_path, spec(server.url, timeout=0.2))
        agent.timer.pause()  # the group lease is not held: the budget does not run
        waiting = asyncio.create_task(agent.wait())
        await asyncio.sleep(0.5)
        assert not waiting.done() and agent.timer.elapsed() < 0.2
        release.set()
        assert (await waiting).exit_code == 0
    assert server.deleted == []


async def test_cancelled_wait_and_terminate_send_delete(tmp_path: Path) -> None:
    with FakeAgentServer(hanging) as server:
        agent = await started(tmp_path, spec(server.url))
        waiting = asyncio.create_task(agent.wait())
        while not server.received:
            await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await agent.terminate()  # idempotent: already ended, no second DELETE
        assert server.deleted == ["s-1"]


async def test_terminate_from_another_task_fails_the_wait(tmp_path: Path) -> None:
    with FakeAgentServer(hanging) as server:
        agent = await started(tmp_path, spec(server.url))
        waiting = asyncio.create_task(agent.wait())
        while not server.received:
            await asyncio.sleep(0.01)
        await agent.terminate()  # the group was dropped by a sibling's failure
        with pytest.raises(AgentFailure, match="cancelled: the session was dropped"):
            await waiting
        assert server.deleted == ["s-1"]


async def test_the_factory_picks_the_executor() -> None:
    assert isinstance(new_agent(AgentSpec(command="true")), AgentProcess)
    assert isinstance(new_agent(spec("http://127.0.0.1:1")), HttpAgent)
    with pytest.raises(ValueError, match=r"agent.executor='slurm'.*\['local', 'http', 'ray'\]"):
        new_agent(AgentSpec(command="true", executor="slurm"))
    with pytest.raises(ValueError, match="needs agent.server_url"):
        new_agent(AgentSpec(command="true", executor="http"))
