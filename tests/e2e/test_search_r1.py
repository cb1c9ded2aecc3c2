"""examples/search_r1 end to end: `python -m relax_pipeline experiment=search_r1` and `search_r1_multi` on the tiny
model (two steps on the CPU, samples written), and scripted runs (`engine=scripted`) whose replies search through a
real tool call and answer correctly, proving the reward path (exact match 1.0) and, for the multi-agent variant,
the contexts `main` and `searcher_<i>` with advantages from the custom advantage hook (outcome × usefulness).
Every run starts the BM25 retriever once (not per session), its log exists, and it is gone after the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from test_e2e_rollout import check_row, read_dump

from relax_pipeline.config import CONF_DIR, REPO_ROOT, quote_placeholders, register
from relax_pipeline.run import run

pytest.importorskip("bm25s", reason="examples/search_r1 needs the examples extra: pip install -e '.[examples]'")

DATA = REPO_ROOT / "examples" / "search_r1" / "data"
STARTED = re.compile(r"service retriever started: pid=(\d+) url=(\S+)")


def cli_run(tmp_path: Path, tiny_path: Path, experiment: str, *overrides: str) -> list[dict]:
    """`python -m relax_pipeline experiment=<name>` as a user runs it (two steps); every dump row of both steps."""
    command = [sys.executable, "-m", "relax_pipeline", f"experiment={experiment}", f"output_dir={tmp_path}",
               f"model.cache_dir={tiny_path.parent}", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [read_dump(tmp_path / "rollout" / f"rollout_{step}.jsonl") for step in (0, 1)]
    assert all(rows) and not (tmp_path / "rollout" / "rollout_2.jsonl").exists()
    check_retriever_once(tmp_path)
    return rows[0] + rows[1]


def check_retriever_once(output_dir: Path) -> int:
    """The retriever was started once and stopped; its log exists; returns how many searches it served."""
    log = (output_dir / "run.log").read_text()
    started = STARTED.findall(log)
    assert len(started) == 1, "one retriever per run, not per session"
    pid = int(started[0][0])
    assert f"service retriever stopped: pid={pid}" in log
    assert not Path(f"/proc/{pid}").exists(), "the retriever was stopped and reaped"
    service_log = (output_dir / "services" / "retriever.log").read_text()
    assert service_log.count("documents indexed") == 1 and "590 documents" in service_log
    return service_log.count("retrieve query=")


def compose_scripted(tmp_path: Path, tiny_path: Path, experiment: str, script: list[dict], *overrides: str):  # noqa: ANN201
    """The experiment on `engine=scripted` with a one-question train set (the first train row)."""
    row = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "script.jsonl").write_text("".join(json.dumps(line) + "\n" for line in script))
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            f"experiment={experiment}", "job=rollout", "rollout.num_steps=1", "rollout.max_response_len=128",
            "engine=scripted", f"engine.script={tmp_path / 'script.jsonl'}", f"dataset.path={tmp_path / 'one.jsonl'}",
            f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", *overrides]))
    return cfg, row["metadata"]


def test_search_r1_runs_two_steps_on_the_tiny_model(tmp_path: Path, tiny_path: Path) -> None:
    rows = cli_run(tmp_path, tiny_path, "search_r1")
    assert len(rows) == 8
    for row in rows:
        check_row(row)
        assert row["name"] is None and row["reward"] in (0.0, 1.0)
        assert {"searches", "turns", "answered", "ended", "prediction"} <= set(row["metadata"])
        assert row["messages"][0]["role"] == "system" and "Question:" in row["messages"][1]["content"]
        assert row["tools"][0]["function"]["name"] == "search"
    assert (tmp_path / "checkpoints" / "step_2").is_dir(), "job=train: two steps trained"


def test_search_r1_multi_runs_two_steps_exporting_main_and_searchers(tmp_path: Path, tiny_path: Path) -> None:
    rows = cli_run(tmp_path, tiny_path, "search_r1_multi")
    sessions: dict[str, list[dict]] = {}
    for row in rows:
        sessions.setdefault(row["session_id"], []).append(row)
    assert len(sessions) == 8
    for contexts in sessions.values():
        assert sorted(r["name"] for r in contexts) == ["main", "searcher_0", "searcher_1"]
        for row in contexts:
            check_row(row)
            outcome = next(r for r in contexts if r["name"] == "main")["metadata"]["outcome"]
            usefulness = row["metadata"].get("usefulness", 1.0)
            assert row["advantage"] == pytest.approx(outcome * usefulness), "the hook's credit, not group RL"


def test_a_scripted_search_then_the_right_answer_scores_one(tmp_path: Path, tiny_path: Path) -> None:
    question = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])["metadata"]
    script = [{"tool_calls": [{"name": "search", "arguments": {"query": question["question"]}}]},
              {"content": f"<answer>{question['answer']}</answer>"}]
    cfg, meta = compose_scripted(tmp_path, tiny_path, "search_r1", script)
    metrics = run(cfg)
    rows = read_dump(tmp_path / "rollout" / "rollout_0.jsonl")
    assert len(rows) == 4 and metrics["rollout/raw_reward"] == 1.0
    for row in rows:
        check_row(row)
        assert row["reward"] == 1.0 and row["turn_count"] == 2
        assert row["metadata"]["searches"] == 1 and row["metadata"]["prediction"] == meta["answer"]
        tool = next(m for m in row["messages"] if m["role"] == "tool")
        assert "Doc 1 (" in tool["content"], "the search went to the retriever and its documents came back"
    assert check_retriever_once(tmp_path) == 4, "one search per session, all served by the one retriever"


def test_a_scripted_multi_agent_session_credits_main_and_useful_searchers(tmp_path: Path, tiny_path: Path) -> None:
    question = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])["metadata"]
    answer = f"<answer>{question['answer']}</answer>"
    # Every context replays the script from line 1: searchers search, then summarize (line 2); main answers on
    # its first turn (line 1's content; the tool call it also carries is ignored by main, which has no tools).
    script = [{"content": answer, "tool_calls": [{"name": "search", "arguments": {"query": question["question"]}}]},
              {"content": f"Found: {question['answer']}"}]
    cfg, _ = compose_scripted(tmp_path, tiny_path, "search_r1_multi", script)
    run(cfg)
    rows = read_dump(tmp_path / "rollout" / "rollout_0.jsonl")
    assert sorted(r["name"] for r in rows) == ["main"] * 4 + ["searcher_0"] * 4 + ["searcher_1"] * 4
    for row in rows:
        check_row(row)
        if row["name"] == "main":
            assert row["reward"] == 1.0 and row["metadata"]["outcome"] == 1.0 and row["advantage"] == 1.0
            assert "[searcher 0]" in row["messages"][1]["content"] and row["turn_count"] == 1
        else:
            assert row["metadata"] == {"usefulness": 1.0, "searches": 1} and row["advantage"] == 1.0
            assert row["turn_count"] == 2 and row["messages"][-1]["content"] == f"Found: {question['answer']}"
    assert check_retriever_once(tmp_path) == 8, "two searchers per session, one retriever per run"


def test_group_rm_with_an_advantage_function_credits_every_context_of_multi_context_sessions(
        tmp_path: Path, tiny_path: Path) -> None:
    """credit=group_rm reviews the main contexts only (searchers stay null) and the advantage function credits all,
    through the real Reward stage of a multi-context run (agent.multi_context=true)."""
    question = json.loads((DATA / "train.jsonl").read_text().splitlines()[0])["metadata"]
    answer = f"<answer>{question['answer']}</answer>"
    script = [{"content": answer, "tool_calls": [{"name": "search", "arguments": {"query": question["question"]}}]},
              {"content": f"Found: {question['answer']}"}]
    cfg, _ = compose_scripted(tmp_path, tiny_path, "search_r1_multi", script, "credit=group_rm",
                              "credit.rm_path=relax_pipeline.credit.examples.main_exact_answer",
                              "credit.advantage_path=relax_pipeline.credit.examples.outcome_times_usefulness")
    run(cfg)
    rows = read_dump(tmp_path / "rollout" / "rollout_0.jsonl")
    assert sorted(r["name"] for r in rows) == ["main"] * 4 + ["searcher_0"] * 4 + ["searcher_1"] * 4
    for row in rows:
        check_row(row)
        assert row["status"] == "completed" and row["advantage"] == 1.0
        assert row["reward"] == (1.0 if row["name"] == "main" else None), "the RM reviewed main only"


def test_job_check_starts_no_service_and_names_a_missing_service_cwd(tmp_path: Path, tiny_path: Path) -> None:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=search_r1", "job=check", f"output_dir={tmp_path}",
                                           f"model.cache_dir={tiny_path.parent}",
                                           f"agent.services.retriever.cwd={tmp_path / 'gone'}"])
    with pytest.raises(ValueError, match=rf"agent.services.retriever.cwd='{tmp_path / 'gone'}' is not a directory"):
        run(cfg)
    assert "check: agent_services = ['retriever']" in (tmp_path / "run.log").read_text()
    assert not (tmp_path / "services").exists(), "job=check starts nothing"


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_stops_the_retriever(tmp_path: Path, tiny_path: Path, signals: int) -> None:
    """One SIGINT: the clean stop ends the retriever in close(); a second SIGINT (exit at once) SIGKILLs it."""
    stubborn = "trap '' TERM; touch $RELAX_SESSION_IO_DIR/started; sleep 120"
    command = [sys.executable, "-m", "relax_pipeline", "experiment=search_r1", "job=rollout", f"output_dir={tmp_path}",
               f"model.cache_dir={tiny_path.parent}", f'agent.command="{stubborn}"']
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "sessions").glob("*/started")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    pid = int(STARTED.findall((tmp_path / "run.log").read_text())[0][0])
    for _ in range(signals):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the retriever outlived the run"


def test_without_bm25s_the_run_fails_at_start_naming_the_extra(tmp_path: Path, tiny_path: Path) -> None:
    """A python without bm25s (a stub module raising ImportError): the retriever exits at once naming the install
    command, and the run fails before any session, its last log line saying so."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "bm25s.py").write_text("raise ImportError('no bm25s here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "relax_pipeline", "experiment=search_r1", f"output_dir={tmp_path}",
                           f"model.cache_dir={tiny_path.parent}"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode != 0
    last = (tmp_path / "run.log").read_text().strip().splitlines()[-1]
    assert ("run failed: ServiceFailure: agent.services.retriever exited with exit code 1 before it was healthy; its "
            "log ends: retriever: the bm25s package is missing; install the examples extra: pip install -e "
            "'.[examples]'") in last
    assert not (tmp_path / "sessions").exists(), "no session started"
