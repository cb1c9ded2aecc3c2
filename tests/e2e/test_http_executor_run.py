"""Whole runs with `agent.executor=http`: sessions go to an agent server (the fake edge
`relax_pipeline.testing.agent_server`) that calls the real gateway and engine; the dump shows the server's
rewards, its failures with their log tails, and an unreachable server is recorded while the run goes on."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from test_e2e_rollout import check_row, compose_config, read_dump

from relax_pipeline.run import run
from relax_pipeline.testing.agent_server import FakeAgentServer, chat_once


def flaky(body: dict[str, Any], cancelled: threading.Event) -> dict[str, Any]:
    """Sums fail on the server with a log line; every other task asks the model once (reward 1.0)."""
    if "+" in body["input"]["messages"][0]["content"]:
        return {"exit_code": 3, "output": "", "log": "Traceback: the server's agent gave up\n"}
    return chat_once(body, cancelled)


def test_server_rewards_and_failures_reach_the_dump(tmp_path: Path, tiny_path: Path) -> None:
    with FakeAgentServer(flaky) as server:
        cfg = compose_config(tmp_path, tiny_path, "agent.executor=http", f"agent.server_url={server.url}",
                             "rollout.batch_size=4", "runtime.external_slots=8")
        run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    completed = [r for r in rows if r["status"] in ("completed", "truncated")]
    failed = [r for r in rows if r["status"] == "failed"]
    assert len({r["group_id"] for r in completed}) == 4, "failed groups are replaced within the step"
    for row in completed:
        check_row(row)
        assert row["reward"] == 1.0 and row["turn_count"] == 1
    assert failed and all("exited with code 3 on the agent server" in r["error"] for r in failed)
    assert all("the server's agent gave up" in r["error"] for r in failed)
    assert {b["session_id"] for b in server.received} == {r["session_id"] for r in rows}
    assert (tmp_path / "sessions" / f"{completed[0]['group_id']}-{completed[0]['index']}" / "output.json").is_file()


def test_unreachable_server_is_recorded_and_the_run_ends(tmp_path: Path, tiny_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    cfg = compose_config(tmp_path, tiny_path, "agent.executor=http", f"agent.server_url={url}",
                         "rollout.batch_size=1")
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert rows and all(r["status"] in ("failed", "dropped") for r in rows)
    assert any("could not reach the agent server" in r["error"] and url in r["error"] for r in rows)
    assert "AGENTIC ROLLOUT event=accounting_end rollout=0" in (tmp_path / "run.log").read_text()


def test_too_few_external_slots_refuse_the_run(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, "agent.executor=http", "agent.server_url=http://127.0.0.1:9",
                         "runtime.external_slots=3")
    with pytest.raises(ValueError, match="runtime.external_slots=3 is too few"):
        run(cfg)
