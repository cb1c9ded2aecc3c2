"""`experiment=mini_swe_agent` end to end: the run starts examples/mini_swe_agent/server.py as a service, sends
each session to it (`agent.executor=http`), the server runs the real mini-swe-agent with its commands in the
sandbox and scores the repository's test in the sandbox.

Two steps of GRPO with the tiny model write samples; `engine=scripted` makes mini-swe-agent run the row's
fixing command and submit, which proves reward 1.0 through the sandboxed test run (and 0.0 without the fix).
Skipped, naming the extra, where mini-swe-agent is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.agent.sandbox import network_isolation
from relax_pipeline.config import CONF_DIR, examples_root, quote_placeholders, register
from relax_pipeline.run import run

pytest.importorskip("minisweagent", reason="mini-swe-agent not installed: pip install -e '.[harness]'")
DATA = examples_root() / "examples" / "mini_swe_agent" / "data.jsonl"
SUBMIT = {"content": "Done.", "tool_calls": [{"name": "bash",
                                              "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}]}


def compose_run(tmp_path: Path, tiny_path: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "experiment=mini_swe_agent", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
            f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl", *overrides]))


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def scripted(tmp_path: Path, tiny_path: Path, script: list[dict], *overrides: str) -> list[dict]:
    """One rollout step on the first repository, every session replaying `script`."""
    row = json.loads(DATA.read_text().splitlines()[0])
    (tmp_path / "one.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "script.jsonl").write_text("".join(json.dumps(line) + "\n" for line in script))
    run(compose_run(tmp_path, tiny_path, "job=rollout", "engine=scripted", f"engine.script={tmp_path}/script.jsonl",
                    f"dataset.path={tmp_path}/one.jsonl", "rollout.num_steps=1", "rollout.batch_size=1",
                    "rollout.max_response_len=256", *overrides))
    return rows_of(tmp_path / "dump" / "r_0.jsonl")


def first_row() -> dict:
    return json.loads(DATA.read_text().splitlines()[0])


def test_two_training_steps_write_samples(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(compose_run(tmp_path, tiny_path))
    for step in (0, 1):
        rows = rows_of(tmp_path / "dump" / f"r_{step}.jsonl")
        trained = [r for r in rows if r["status"] in ("completed", "truncated")]
        assert trained, [(r["status"], r["error"]) for r in rows]
        for row in trained:
            assert row["reward"] in (0.0, 1.0) and 1 in row["loss_mask"]
            # the untrained model's replies carry no tool call: mini-swe-agent drops each one and re-asks, so a
            # session forks at every call and exports one row per chain (`branch`)
            assert row["metadata"]["exit_status"] and 1 <= row["turn_count"] <= row["metadata"]["model_calls"]
    assert metrics["train/weight_version"] == 2.0
    assert (tmp_path / "services" / "server.log").is_file()


def test_scripted_fix_earns_reward_one_through_the_sandboxed_test(tmp_path: Path, tiny_path: Path) -> None:
    row = first_row()
    command = row["metadata"]["test_command"]
    rows = scripted(tmp_path, tiny_path, [
        {"content": "Fix the function.", "tool_calls": [{"name": "bash", "arguments": {"command": row["solution"]}}]},
        {"content": "Run the test.", "tool_calls": [{"name": "bash", "arguments": {"command": command}}]},
        SUBMIT,
    ])
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows), [r["error"] for r in rows]
    for result in rows:
        assert result["reward"] == 1.0 and result["turn_count"] == 3
        assert result["metadata"] == {"exit_status": "Submitted", "tests_passed": True, "model_calls": 3}
        observation = [m["content"] for m in result["messages"] if m["role"] == "tool"][1]  # the test's output
        assert '"returncode": 0' in observation and "OK" in observation


def test_submitting_without_the_fix_earns_zero(tmp_path: Path, tiny_path: Path) -> None:
    rows = scripted(tmp_path, tiny_path, [SUBMIT])
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    assert all(r["reward"] == 0.0 and r["metadata"]["tests_passed"] is False for r in rows)


def test_timeout_cancels_the_session_on_the_server(tmp_path: Path, tiny_path: Path) -> None:
    rows = scripted(tmp_path, tiny_path, [
        {"content": "Wait.", "tool_calls": [{"name": "bash", "arguments": {"command": "sleep 60"}}]}, SUBMIT,
    ], "agent.timeout=2")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed and all(r["status"] in ("failed", "dropped") for r in rows)
    assert "timed out after 2 s of active time" in failed[0]["error"]
    assert '"cancelled":true' in failed[0]["error"], "the server knew the session and cancelled it"


@pytest.mark.skipif(network_isolation() is None, reason="this platform can isolate the network")
def test_without_network_isolation_sessions_fail_naming_the_fix(tmp_path: Path, tiny_path: Path) -> None:
    rows = scripted(tmp_path, tiny_path, [SUBMIT])
    assert rows and all(r["status"] in ("failed", "dropped") for r in rows)
    assert any("sandbox.allow_network=true" in r["error"] for r in rows if r["status"] == "failed")
