"""End to end: `job=rollout` with the real engine, gateway, and subprocess agents using the openai SDK.

Checks every dump invariant of docs/design.md §3.4, that each turn's prompt starts with the previous turn's
prompt and output tokens, and that failing agents are recorded (failed + dropped rows) while the run
goes on, replacing the dropped groups within the step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run
from relax_pipeline.testing.engines import RecordingHFEngine

FIELDS = {
    "rollout_id", "group_id", "session_id", "index", "name", "branch", "mode", "status", "outcome", "error", "reward",
    "advantage", "metadata", "messages", "tools", "chat_template_kwargs", "state_hash", "tokens", "loss_mask",
    "rollout_logprobs", "weight_versions", "prompt_length", "response_length", "turn_count", "abort_count",
    "timing",
}


def compose_config(tmp_path: Path, tiny_path: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "job=rollout", "agent=minimal", "dataset=toy", "rollout.num_steps=1", "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=12", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
            f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl", *overrides,
        ]))


def read_dump(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_row(row: dict) -> None:
    assert set(row) == FIELDS
    assert len(row["tokens"]) == row["prompt_length"] + row["response_length"]
    n = row["response_length"]
    assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["weight_versions"]) == n
    for mask, logprob in zip(row["loss_mask"], row["rollout_logprobs"], strict=True):
        assert mask in (0, 1)
        assert (logprob == 0.0) if mask == 0 else (logprob <= 0.0)
    assert row["loss_mask"][0] == 1 and row["status"] in ("completed", "truncated")
    turns = row["timing"]["turns"]
    assert len(turns) == row["turn_count"], "one timing entry per generated turn"
    for t in turns:
        assert min(t.values()) >= 0 and t["total_ms"] == pytest.approx(t["queue_ms"] + t["generation_ms"], abs=0.01)


def test_rollout_three_turns_with_openai_sdk_agents(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, "engine._target_=relax_pipeline.testing.engines.RecordingHFEngine")
    metrics = run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 4 and all(r["turn_count"] == 3 for r in rows)
    for row in rows:
        check_row(row)
        assert row["name"] == "main" and row["mode"] == "train" and row["reward"] in (0.0, 1.0)
        assert row["messages"][-1]["role"] == "assistant" and row["tools"]
    assert sum(r["advantage"] for r in rows) == pytest.approx(0.0, abs=1e-9)
    assert metrics["rollout/num_turns/mean"] == 3
    _check_prompt_prefixes(RecordingHFEngine.last.calls, rows)
    log = (tmp_path / "run.log").read_text()
    assert "AGENTIC ROLLOUT event=accounting_end rollout=0 groups=2 rows=4 dropped=0" in log


def _check_prompt_prefixes(calls: list[tuple[list[int], list[int]]], rows: list[dict]) -> None:
    """Every call after a session's first starts with an earlier call's prompt + output."""
    finished = [prompt + output for prompt, output in calls]
    later = [prompt for prompt, _ in calls if len(prompt) > min(len(p) for p, _ in calls) + 40]
    assert len(calls) == 12 and later
    for prompt in later:
        assert any(prompt[: len(done)] == done for done in finished if len(done) < len(prompt))
    for row in rows:
        assert any(row["tokens"][: len(done)] == done for done in finished)


def test_failing_agents_are_recorded_and_the_run_goes_on(tmp_path: Path, tiny_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.load(open(os.environ['RELAX_INPUT_JSON']))\n"
        "if '+' in task['messages'][0]['content']:\n"
        "    print('agent gave up on purpose'); sys.exit(3)\n"
        "import openai\n"
        "c = openai.OpenAI(base_url=os.environ['RELAX_BASE_URL'], api_key=os.environ['RELAX_API_KEY'])\n"
        "c.chat.completions.create(model='m', messages=task['messages'])\n"
        "json.dump({'reward': 1.0}, open(os.environ['RELAX_OUTPUT_JSON'], 'w'))\n"
    )
    cfg = compose_config(tmp_path, tiny_path, f"agent.command='{sys.executable} {script}'",
                         "rollout.batch_size=4")
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    failed = [r for r in rows if r["status"] == "failed"]
    dropped = [r for r in rows if r["status"] == "dropped"]
    assert failed and all("exited with code 3" in r["error"] and "gave up on purpose" in r["error"] for r in failed)
    assert all(r["error"] for r in dropped)
    siblings = {r["group_id"] for r in dropped if not r["error"].startswith("surplus")}
    assert siblings <= {r["group_id"] for r in failed}
    completed = {r["group_id"] for r in rows if r["status"] in ("completed", "truncated")}
    assert len(completed) == 4, "failed groups are replaced within the step"
    for row in rows:
        if row["status"] in ("completed", "truncated"):
            check_row(row)
            assert row["turn_count"] == 1 and row["name"] is None


def test_seed_minimal_agent_exports_implicitly(tmp_path: Path, tiny_path: Path) -> None:
    cfg = compose_config(tmp_path, tiny_path, "agent=single_turn", "rollout.batch_size=1")
    run(cfg)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl")
    assert len(rows) == 2
    for row in rows:
        check_row(row)
        assert row["name"] is None and row["turn_count"] == 1 and row["reward"] in (0.0, 1.0)
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
