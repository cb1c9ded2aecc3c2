"""`agent.services`: real `bash` service processes, a real HTTP health endpoint, real log files, no mocks.

A healthy service is started once, answers, and is gone after `stop` (its whole group, a child included); a
service that exits before it is healthy and one whose health URL never answers fail naming the service, the
reason and the log, with nothing left running; bad entries fail naming `agent.services.<name>.<key>`; a service
that dies mid-run is reported with its log tail; one that ignores SIGTERM is killed after the grace period.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path

import httpx
import pytest
from test_agent_launcher import process_gone

from relax_pipeline.agent.launcher import _group_alive
from relax_pipeline.agent.services import ServiceFailure, Services, ServiceSpec, service_problems
from relax_pipeline.infra.ports import free_port

SERVER = '''
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
print("service ready on", sys.argv[1], flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''


def health_service(tmp_path: Path, **extra: object) -> dict:
    """A service entry running SERVER on a free port, with a child `sleep` in its group."""
    (tmp_path / "server.py").write_text(SERVER)
    port = free_port()
    return {"command": f"sleep 300 & exec {sys.executable} server.py {port}", "cwd": str(tmp_path), "port": port,
            "health_url": f"http://127.0.0.1:{port}/health", "startup_timeout": 30, **extra}


@pytest.mark.asyncio
async def test_a_healthy_service_starts_once_answers_and_is_gone_after_stop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="relax_pipeline")
    entry = health_service(tmp_path, env={"GREETING": "hello from env"})
    entry["command"] = 'echo "$GREETING"; ' + entry["command"]
    services = Services({"index": entry}, tmp_path / "out", grace_s=1.0)
    await services.start()
    [service] = services.running
    pid = service.pid
    assert pid is not None and _group_alive(pid)
    async with httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(entry["health_url"])).status_code == 200
    await services.stop()
    assert not _group_alive(pid) and process_gone(pid) and not services.running
    log = (tmp_path / "out" / "services" / "index.log").read_text()
    assert "hello from env" in log and f"service ready on {entry['port']}" in log
    assert f"service index started: pid={pid} url={entry['health_url']}" in caplog.text
    assert f"service index stopped: pid={pid}" in caplog.text
    await services.stop()  # idempotent


@pytest.mark.asyncio
async def test_a_service_that_exits_before_it_is_healthy_fails_naming_it_and_its_log(tmp_path: Path) -> None:
    first = health_service(tmp_path)
    broken = {"command": "echo 'index file missing' >&2; exit 3", "health_url": "http://127.0.0.1:9/health"}
    services = Services({"first": first, "broken": broken}, tmp_path, grace_s=1.0)
    with pytest.raises(ServiceFailure) as caught:
        await services.start()
    text = str(caught.value)
    assert text.startswith("agent.services.broken exited with exit code 3 before it was healthy; its log ends: "
                           "index file missing (full log: ")
    assert str(tmp_path / "services" / "broken.log") in text and "index file missing" in text
    assert not services.running, "the healthy service started first is stopped too"
    async with httpx.AsyncClient(trust_env=False) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(first["health_url"])


@pytest.mark.asyncio
async def test_a_health_url_that_never_answers_times_out_and_leaves_nothing_running(tmp_path: Path) -> None:
    port = free_port()
    entry = {"command": "echo starting; sleep 300", "health_url": f"http://127.0.0.1:{port}/health",
             "startup_timeout": 0.5}
    services = Services({"slow": entry}, tmp_path, grace_s=1.0)
    start = asyncio.ensure_future(services.start())
    while not services.running:
        await asyncio.sleep(0.01)
    pid = services.running[0].pid
    with pytest.raises(ServiceFailure, match=rf"agent.services.slow did not answer http://127.0.0.1:{port}/health "
                                             r"with a 2xx within startup_timeout=0.5 s; its log ends: starting"):
        await start
    assert pid is not None and not _group_alive(pid) and process_gone(pid)


@pytest.mark.asyncio
async def test_a_service_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    services = Services({"stubborn": {"command": "trap '' TERM; sleep 300 & wait"}}, tmp_path, grace_s=0.3)
    await services.start()
    pid = services.running[0].pid
    assert pid is not None and _group_alive(pid)
    await services.stop()
    assert not _group_alive(pid)


@pytest.mark.asyncio
async def test_a_service_dying_mid_run_is_reported_with_its_log_tail(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    services = Services({"flaky": {"command": "sleep 0.3; echo 'out of memory'; exit 9"}}, tmp_path, grace_s=1.0)
    await services.start()
    for _ in range(200):
        if "flaky exited" in caplog.text:
            break
        await asyncio.sleep(0.02)
    await services.stop()
    assert "agent.services.flaky exited with exit code 9 while the run goes on" in caplog.text
    assert "out of memory" in caplog.text


@pytest.mark.parametrize(("services", "message"), [
    ({"idx": {"command": "true", "helth_url": "x"}}, "agent.services.idx.helth_url is not a service key"),
    ({"idx": {"cwd": "/tmp"}}, "agent.services.idx.command is missing"),
    ({"idx": {"command": "true", "env": {"RELAX_PORT": "1"}}}, "agent.services.idx.env.RELAX_PORT: the RELAX_ prefix"),
    ({"idx": {"command": "true", "startup_timeout": 0}}, "agent.services.idx.startup_timeout=0 must be a positive"),
    ({"idx": {"command": "true", "port": "80"}}, "agent.services.idx.port='80' must be an integer"),
    ({"a/b": {"command": "true"}}, "agent.services.a/b: a service name is letters"),
    ({"idx": "python serve.py"}, "agent.services.idx must be a mapping"),
])
def test_bad_entries_fail_naming_the_key(tmp_path: Path, services: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Services(services, tmp_path)
    assert service_problems(services)[0].startswith(message)


def test_job_check_problems_name_a_missing_cwd(tmp_path: Path) -> None:
    services = {"ok": {"command": "true", "cwd": str(tmp_path)}, "gone": {"command": "true", "cwd": "/nope/x"}}
    assert service_problems(services) == ["agent.services.gone.cwd='/nope/x' is not a directory"]
    assert ServiceSpec.parse("ok", services["ok"]).cwd == str(tmp_path)
