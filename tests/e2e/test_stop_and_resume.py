"""Ctrl-C that saves, checkpoints that are models, and `job=eval` on them, through the real CLI.

A `python -m relax_pipeline` subprocess trains the tiny model; its agents sleep in step 1 (while a file
`sleep_in_step_1` exists), so a SIGINT lands mid-step: the run must exit 130 without a traceback, record the
in-flight sessions as dropped in the dump, write a checkpoint of step 0's result that loads as a Hugging Face
folder and as `model.path`, and say how to resume. Resuming from it equals an uninterrupted run exactly,
`job=eval` evaluates it (metrics, per-problem CSV, summary line), and a second SIGINT exits at once.
Real engine, gateway, trainer and subprocess agents (plain HTTP, one model call).
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from relax_pipeline.config import CONF_DIR, quote_placeholders, records, register
from relax_pipeline.recipes.parts import capacity_of, eval_sets
from relax_pipeline.run import run

DIGITS_AGENT = Path(__file__).resolve().parents[1] / "agents" / "digits_agent.py"
HOLD = ["+agent.env.HOLD_GROUP=g1-", "+agent.env.HOLD_FILE=sleep_in_step_1"]
"""The digits agent waits in train groups `g1-*` while `sleep_in_step_1` exists in the work folder."""
STUBBORN = "trap '' TERM; echo $$ > $RELAX_SESSION_IO_DIR/pid; sleep 120"
"""An agent that ignores SIGTERM: the first SIGINT's clean stop waits `agent.grace_s` for it."""


def overrides(out: Path, tiny_path: Path, *extra: str) -> list[str]:
    data = out.parent / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + {i}?", "metadata": {"i": i}}) + "\n"
                            for i in range(3)))
    return [f"output_dir={out}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}", "dataset.shuffle=false",
            f"agent.command='{sys.executable} {DIGITS_AGENT}'", *HOLD, f"agent.cwd={out.parent}", "rollout.num_steps=2",
            "rollout.batch_size=1", "rollout.n_samples_per_prompt=2", "rollout.max_response_len=6",
            "engine.max_batch_size=1", "engine.kv_cache_mb=0", "trainer.optim.lr=5e-3", "trainer.keep_checkpoints=1",
            f"debug.save_rollout_data={out}/dump/r_{{rollout_id}}.jsonl", *extra]


def compose_config(items: list[str]):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders(items))


def start_cli(items: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relax_pipeline", *items, f"hydra.run.dir={cwd}/hydra"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(paths: Callable[[], list[Path]], proc: subprocess.Popen, limit_s: float = 300) -> list[Path]:
    deadline = time.monotonic() + limit_s
    while not (found := paths()):
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the agents of step 1 never started"
        time.sleep(0.2)
    return found


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sigint_saves_a_loadable_checkpoint_that_resumes_exactly_and_evaluates(tmp_path: Path,
                                                                                tiny_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "sleep_in_step_1").touch()
    out = work / "interrupted"
    proc = start_cli(overrides(out, tiny_path, "job=train"), work)
    wait_for(lambda: list((out / "sessions").glob("g1-*/started")), proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    folder = out / "checkpoints"
    checkpoint = folder / "step_1"
    assert stderr.strip().splitlines()[-1].endswith(f"checkpoint {folder}/step_1; resume with trainer.resume=true "
                                                    f"trainer.checkpoint_dir={folder}")
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", "model.safetensors",
            "optimizer.pt", "trainer_state.pt"} <= {p.name for p in checkpoint.iterdir()}
    step1 = read(out / "dump" / "r_1.jsonl")
    assert step1 and {(r["status"], r["error"]) for r in step1} == {("dropped", "interrupted by SIGINT")}
    assert len([r for r in read(out / "dump" / "r_0.jsonl") if r["status"] in ("completed", "truncated")]) == 2

    (work / "sleep_in_step_1").unlink()
    run(compose_config(overrides(out, tiny_path, "job=train", "trainer.resume=true",
                                 f"trainer.checkpoint_dir={folder}")))
    straight = work / "straight"
    run(compose_config(overrides(straight, tiny_path, "job=train")))
    resumed = read(out / "dump" / "r_1.jsonl")
    assert resumed[:len(step1)] == step1, "the resumed run appends to the dump; the dropped rows stay"
    assert [r["tokens"] for r in resumed[len(step1):]] == [r["tokens"] for r in read(straight / "dump" / "r_1.jsonl")]
    a, b = (load_file(o / "checkpoints" / "step_2" / "model.safetensors") for o in (out, straight))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in folder.iterdir()) == ["step_2"], "trainer.keep_checkpoints=1"

    evaluated, data = work / "eval", work / "data.jsonl"
    metrics = run(compose_config(overrides(evaluated, tiny_path, "job=eval", f"model.path={folder}/step_2",
                                           "rollout.num_steps=0", f"eval.datasets=[{{name:toy,path:{data}}}]")))
    assert not (evaluated / "checkpoints").exists()
    lines = (evaluated / "eval_toy.csv").read_text().splitlines()
    assert lines[0] == "problem,prompt,samples,scored,reward,passed,statuses,response,metadata" and len(lines) == 4
    problems = list(csv.DictReader(lines))
    assert [p["problem"] for p in problems] == ["0", "1", "2"]
    rewards = [sum(ch.isdigit() for ch in p["response"]) / 4.0 for p in problems]
    assert [float(p["reward"]) for p in problems] == rewards, "the digits agent's reward of the evaluated answer"
    assert metrics["eval/toy/raw_reward"] == pytest.approx(sum(rewards) / 3)
    assert "eval toy: problems=3 raw_reward=" in (evaluated / "run.log").read_text()
    assert not list((evaluated / "dump").glob("r_[0-9]*.jsonl")), "job=eval runs no rollout step"


def test_a_second_sigint_exits_at_once_killing_the_agents(tmp_path: Path, tiny_path: Path) -> None:
    work = tmp_path
    out = work / "out"
    proc = start_cli(overrides(out, tiny_path, "job=rollout", f"agent.command=\"{STUBBORN}\"", "agent.cwd=null"),
                     work)
    pids = wait_for(lambda: list((out / "sessions").glob("g0-*/pid")), proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr
    assert "SIGINT again: killing the running agents and exiting now, without a checkpoint" in stderr
    for pid_file in pids:
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"agent {pid} outlived the run"


def _alive(pid: int) -> bool:
    """Running (a zombie left for a container's init to reap counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_job_eval_concurrency_defaults_to_the_engine_batch(tmp_path: Path, tiny_path: Path) -> None:
    base = overrides(tmp_path / "out", tiny_path, "job=eval", "engine.max_batch_size=6", "eval.n_samples_per_prompt=2",
                     f"eval.datasets=[{{name:toy,path:{tmp_path}/data.jsonl}}]")
    for extra, concurrency in (([], 3), (["runtime.eval_concurrency=2"], 2), (["job=train"], 1)):
        cfg = compose_config([*base, *extra])
        config = records(cfg)
        assert eval_sets(config, capacity_of(config))[0].concurrency == concurrency, extra
