"""Whole runs with the `gateway.*` keys: the base URL agents get and the credentials they may send.

Loopback (the default): an agent that sends `Authorization: Bearer $RELAX_SESSION_ID` (docs/design.md §3.3) is
served. `gateway.host=0.0.0.0 gateway.allow_remote=true gateway.public_url=...`: every agent's
`RELAX_BASE_URL` is the public URL, the gateway answers at it, and a session id is refused (401) while
`RELAX_API_KEY` is served. A remote bind without `gateway.allow_remote` stops the run before anything starts.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from test_e2e_rollout import compose_config, read_dump

from relax_pipeline.gateway.server import machine_address
from relax_pipeline.run import run

AGENT = Path(__file__).resolve().parent.parent / "agents" / "bearer_agent.py"
SCRIPT_LINE = '{"content": "4"}\n'


def overrides(tmp_path: Path, credential: str, *extra: str) -> list[str]:
    script = tmp_path / "script.jsonl"
    script.write_text(SCRIPT_LINE)
    return ["engine=scripted", f"engine.script={script}", f"agent.command={sys.executable} {AGENT}",
            f"+agent.env.BEARER_AGENT_CREDENTIAL={credential}", "rollout.max_response_len=8", *extra]


def test_a_loopback_run_serves_agents_that_send_their_session_id(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(compose_config(tmp_path, tiny_path, *overrides(tmp_path, "session_id")))
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and metrics["rollout/dropped_groups"] == 0
    for row in rows:
        assert row["status"] == "completed" and row["turn_count"] == 1, row["error"]
        assert row["metadata"]["id_status"] == 200
        assert row["metadata"]["base_url"].startswith("http://127.0.0.1:")


def test_a_remote_run_gives_agents_the_public_url_and_takes_keys_only(tmp_path: Path, tiny_path: Path) -> None:
    address = machine_address()
    if address == "127.0.0.1":
        pytest.skip("this machine has no non-loopback IPv4 address to publish")
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        port = probe.getsockname()[1]
    public = f"http://{address}:{port}/agentic_api/"
    gateway = ["gateway.host=0.0.0.0", f"gateway.port={port}", "gateway.allow_remote=true",
               f"gateway.public_url={public}"]
    metrics = run(compose_config(tmp_path, tiny_path, *overrides(tmp_path, "api_key", *gateway)))
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and metrics["rollout/dropped_groups"] == 0
    for row in rows:
        assert row["status"] == "completed", row["error"]
        assert row["metadata"] == {**row["metadata"], "base_url": public, "id_status": 401}
    log = (tmp_path / "run.log").read_text()
    assert f"gateway serving at http://0.0.0.0:{port}/agentic_api/, agents use {public}" in log


def test_a_remote_bind_without_allow_remote_starts_nothing(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, *overrides(tmp_path, "api_key", "gateway.host=0.0.0.0"))
    with pytest.raises(ValueError, match="gateway.host='0.0.0.0' is not a loopback address.*gateway.allow_remote"):
        run(cfg)
    assert not (tmp_path / "dump").exists() and not (tmp_path / "sessions").exists()
