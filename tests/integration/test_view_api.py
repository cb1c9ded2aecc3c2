"""The run viewer's HTTP API under uvicorn on 127.0.0.1:0 (`ViewServer`), and both ways to start it as a process
(`python -m relax_pipeline.view DIR --port 0` and `python -m relax_pipeline job=view view.dir=DIR`, also on a
replay bundle folder)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relax_pipeline.testing.run_folders import dump_row, step_rows, write_bundle, write_run_folder, write_traces
from relax_pipeline.view.server import ViewServer

URL_LINE = re.compile(r"at (http://127\.0\.0\.1:\d+/)")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_run_folder(tmp_path / "run", steps=2, sessions=120, fork_every=4, fail_every=10)


@pytest.fixture
def client(folder: Path, tiny_path: Path) -> Iterator[httpx.Client]:
    server = ViewServer(folder, tokenizer=str(tiny_path)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield http
    finally:
        server.stop()


def test_the_page_and_its_assets_are_served_from_the_package(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "/static/viewer.js" in page.text and "http" not in page.text.split("<body>")[1]
    for asset in ("/static/viewer.js", "/static/charts.js", "/static/viewer.css",
                  "/static/vendor/uplot/uPlot.iife.min.js", "/static/vendor/uplot/uPlot.min.css"):
        assert client.get(asset).status_code == 200 and f'"{asset}"' in page.text
    assert "MIT" in client.get("/static/vendor/uplot/LICENSE").text


def test_overview_and_metrics(client: httpx.Client, folder: Path) -> None:
    run = client.get("/api/run").json()
    assert run["folder"] == str(folder.resolve()) and [s["id"] for s in run["steps"]] == ["0", "1"]
    assert run["metrics_source"] == "metrics.jsonl" and run["job"] == "train"
    curves = client.get("/api/metrics").json()["curves"]
    assert [p[0] for p in curves["rollout/raw_reward"]] == [0, 1]


def test_sessions_are_paged_and_filtered_by_status(client: httpx.Client) -> None:
    first = client.get("/api/steps/1/sessions", params={"limit": 50}).json()
    assert first["total"] == 120 and len(first["sessions"]) == 50 and first["counts"]["failed"] == 12
    last = client.get("/api/steps/1/sessions", params={"limit": 50, "offset": 100}).json()
    assert len(last["sessions"]) == 20 and last["sessions"][-1]["session_id"] == "sess-1-119"
    dropped = client.get("/api/steps/1/sessions", params={"status": "dropped"}).json()
    assert dropped["total"] == 12 and {s["status"] for s in dropped["sessions"]} == {"dropped"}
    bad = client.get("/api/steps/1/sessions", params={"status": "done"})
    assert bad.status_code == 404 and "choose one of" in bad.json()["detail"]
    missing = client.get("/api/steps/7/sessions")
    assert missing.status_code == 404 and "step '7'" in missing.json()["detail"]


def test_a_forked_session_has_its_tree_fork_record_and_decoded_tokens(client: httpx.Client) -> None:
    session = client.get("/api/steps/0/sessions/sess-0-2").json()
    assert [c["branch"] for c in session["contexts"]] == [0, 1]
    assert session["forks"] and session["forks"][0]["message_index"] == 1
    forked = [n for n in session["tree"] if len(n["children"]) == 2]
    assert len(forked) == 1 and forked[0]["forks"] and forked[0]["role"] == "user"
    context = session["contexts"][0]
    assert len(context["pieces"]) == len(context["tokens"]) and not context["pieces"][0].startswith("#")
    assert client.get("/api/steps/0/sessions/nope").status_code == 404


def test_a_session_s_trace_and_the_version_its_step_trained(client: httpx.Client, folder: Path) -> None:
    assert client.get("/api/steps/1/sessions/sess-1-3").json()["trained_version"] == 1
    missing = client.get("/api/steps/1/sessions/sess-1-3/trace")
    assert missing.status_code == 404 and "no trace recorded (tracking.traces=false?)" in missing.json()["detail"]
    write_traces(folder, 1, {"sess-1-3": [0, 1]})
    assert client.get("/api/run").json()["traces"] is True
    trace = client.get("/api/steps/1/sessions/sess-1-3/trace").json()
    assert trace["file"] == "traces/step_1.jsonl" and trace["spans"][0]["name"] == "session"
    assert [s["attributes"]["relax.weight_version"] for s in trace["spans"] if s["name"] == "turn"] == [0, 1]


def test_a_refresh_shows_a_running_runs_new_step(client: httpx.Client, folder: Path) -> None:
    rows = [dump_row(random.Random(2), 2, s, version=2) for s in range(3)]
    (folder / "dump" / "rollout_2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "time": 0.0, "metrics": {"rollout/raw_reward": 0.75}}) + "\n")
    assert [s["id"] for s in client.get("/api/run").json()["steps"]] == ["0", "1", "2"]
    assert client.get("/api/metrics").json()["curves"]["rollout/raw_reward"][-1] == [2, 0.75]
    assert client.get("/api/steps/2/sessions").json()["total"] == 3


@pytest.mark.parametrize("command", [
    ["-m", "relax_pipeline.view", "{dir}", "--port", "0"],
    ["-m", "relax_pipeline", "job=view", "view.dir={dir}", "view.port=0", "hydra.run.dir={tmp}/hydra"],
])
def test_the_viewer_starts_as_a_process(command: list[str], folder: Path, tmp_path: Path) -> None:
    args = [a.format(dir=folder, tmp=tmp_path) for a in command]
    before = sorted(p.name for p in folder.iterdir())
    process = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _url(process)
        assert httpx.get(url + "api/run", timeout=30).json()["steps"][0]["id"] == "0"
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    assert sorted(p.name for p in folder.iterdir()) == before, "the viewer writes nothing into the run folder"


def test_a_replay_bundle_opens_directly(tmp_path: Path) -> None:
    rows = step_rows(random.Random(1), 3, 4, fork_every=4, fail_every=0, response=6)
    bundle = write_bundle(tmp_path / "replay" / "step_3", 3, rows, {"train/loss": 0.5, "train/weight_version": 4.0})
    server = ViewServer(bundle).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            run = http.get("/api/run").json()
            assert run["bundle"] == {"step": 3, "format_version": 1} and [s["id"] for s in run["steps"]] == ["3"]
            assert http.get("/api/metrics").json()["curves"]["train/loss"] == [[3, 0.5]]
            groups = http.get("/api/bundle").json()["groups"]
            assert [c["session_id"] for g in groups for c in g["contexts"]] == [r["session_id"] for r in rows]
            assert http.get("/api/steps/3/sessions").json()["total"] == 4
            assert http.get("/api/steps/3/sessions/sess-3-2").json()["trained_version"] == 3
    finally:
        server.stop()


def test_job_view_serves_a_bundle_folder(tmp_path: Path) -> None:
    rows = step_rows(random.Random(1), 2, 2, fork_every=0, fail_every=0, response=4)
    bundle = write_bundle(tmp_path / "replay" / "step_2", 2, rows, {"train/loss": 0.5})
    process = subprocess.Popen([sys.executable, "-m", "relax_pipeline", "job=view", f"view.dir={bundle}",
                                "view.port=0", f"hydra.run.dir={tmp_path}/hydra"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert httpx.get(_url(process) + "api/bundle", timeout=30).json()["manifest"]["step"] == 2
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def test_a_run_folder_is_not_a_bundle(client: httpx.Client) -> None:
    assert client.get("/api/run").json()["bundle"] is None
    assert "not a replay bundle" in client.get("/api/bundle").json()["detail"]


def _url(process: subprocess.Popen) -> str:
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if match := URL_LINE.search(line):
            return match.group(1)
    raise AssertionError("the viewer printed no URL:\n" + "".join(seen))
