"""`job=check check.sessions=N` certifies an agent app: scripted agents with one habit each
(`tests/agents/drift_agent.py`; `tests/agents/editing_agent.py`, which edits the model's earlier replies) through
`engine=scripted` (a script that emits reasoning and a tool call, or plain replies), each getting the verdict and the
cause it should, in `check/certificate.json`, the metrics and the CLI's exit status; bad input (an agent that never
calls the model, an engine that cannot be reached or cannot answer) is a failed stage."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.certify import certificate as cert
from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run

AGENT = Path(__file__).resolve().parents[1] / "agents" / "drift_agent.py"
EDITING_AGENT = AGENT.with_name("editing_agent.py")
CALL = {"name": "read", "arguments": {"path": "a.py", "line": 3}}
SCRIPT = "".join(json.dumps(line) + "\n" for line in ({"reasoning": "I should read it.", "tool_calls": [CALL]},
                                                       {"reasoning": "It prints.", "content": "It prints hi."}))
REPLIES = "".join(json.dumps({"content": text}) + "\n" for text in ("Hello there, it prints hi.", "Then it prints bye.",
                                                                    "That is all."))
"""The editing agent's script: three plain replies."""


def overrides(tmp_path: Path, tiny_path: Path, mode: str, *extra: str, agent: Path = AGENT,
              script_text: str = SCRIPT) -> list[str]:
    script = tmp_path / "script.jsonl"
    script.write_text(script_text)
    engine = [e for e in extra if e.startswith("engine=")] or ["engine=scripted", f"engine.script={script}"]
    return quote_placeholders([
        "job=check", "check.sessions=2", "dataset=toy", *engine,
        f"agent.command='{sys.executable} {agent} {mode}'", "agent.cwd=null", "rollout.max_response_len=256",
        "rollout.max_context_len=2048", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
        *(e for e in extra if not e.startswith("engine="))])


def checked(tmp_path: Path, tiny_path: Path, mode: str, *extra: str, **agent: Any) -> cert.Certificate:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides(tmp_path, tiny_path, mode, *extra, **agent))
    metrics = run(cfg)
    found = cert.read(tmp_path)
    assert metrics["check/exit_status"] == found.exit_status
    assert (tmp_path / "check" / "certificate.md").read_text().startswith("# Agent app certificate")
    return found


def causes(found: cert.Certificate) -> dict[str, cert.Cause]:
    return {c.cause: c for c in found.causes}


def test_a_verbatim_replay_is_training_grade(tmp_path: Path, tiny_path: Path) -> None:
    found = checked(tmp_path, tiny_path, "verbatim")
    assert found.verdict == cert.TRAINING_GRADE and found.causes == ()
    assert [s.verdict for s in found.stages] == ["pass"] * len(cert.STAGES), found.stages
    export = found.stage("export").evidence
    assert export["loss_mask_coverage"] == 1.0 and set(export["topology"].values()) == {"linear"}
    assert found.stage("sessions").evidence["turns"] == 4


def test_dropped_reasoning_forks_under_render_and_names_the_key_that_fixes_it(tmp_path: Path, tiny_path: Path
                                                                              ) -> None:
    found = checked(tmp_path, tiny_path, "drop_reasoning", "rollout.history=render")
    dropped = causes(found)["reasoning_dropped"]
    assert found.verdict == cert.DEGRADED and set(causes(found)) == {"reasoning_dropped"}
    assert dropped.forks == 2 and dropped.tokens_duplicated > 0 and dropped.fix == "rollout.history=tokens"
    assert set(found.stage("export").evidence["topology"].values()) == {"leaves"}


def test_dropped_reasoning_is_absorbed_under_tokens(tmp_path: Path, tiny_path: Path) -> None:
    found = checked(tmp_path, tiny_path, "drop_reasoning")
    dropped = causes(found)["reasoning_dropped"]
    assert found.verdict == cert.TRAINING_GRADE and dropped.turns == 2 and dropped.forks == 0 and not dropped.costly
    first = found.stage("template").evidence["first_differences"][0]["first_difference"]
    assert first["cause"] == "reasoning_dropped" and "<think>" in first["held"]


def test_reserialized_arguments_are_matched_as_json(tmp_path: Path, tiny_path: Path) -> None:
    found = checked(tmp_path, tiny_path, "reserialize")
    assert found.verdict == cert.TRAINING_GRADE and found.stage("forks").evidence["forks"] == 0


@pytest.mark.parametrize("mode, cause", [("flatten", "tool_call_flattened"), ("malformed", "tool_arguments_malformed")])
def test_a_rewritten_tool_call_forks_and_is_degraded(tmp_path: Path, tiny_path: Path, mode: str, cause: str) -> None:
    found = checked(tmp_path, tiny_path, mode)
    assert found.verdict == cert.DEGRADED and set(causes(found)) == {cause}
    assert causes(found)[cause].forks == 2 and causes(found)[cause].fix.startswith("harness: ")


@pytest.mark.parametrize("mode, edit, held_token, sent_token", [
    ("recase", "re-cased", "Hello", "he"), ("respace", "re-spaced", " the", " "),  # the tiny tokenizer's cuts
    ("append", "appended to", "<|im_end|>", " "),
])
def test_an_agent_that_edits_its_earlier_replies_names_the_edit_the_token_and_the_fix(
        tmp_path: Path, tiny_path: Path, mode: str, edit: str, held_token: str, sent_token: str) -> None:
    """Re-cased, re-spaced or appended to, an earlier reply the model generated forks the session: cause
    edited_reply (not unknown), how it was edited, the first differing token decoded on both sides, and the fix."""
    found = checked(tmp_path, tiny_path, mode, agent=EDITING_AGENT, script_text=REPLIES)
    edited = causes(found)["edited_reply"]
    assert found.verdict == cert.DEGRADED and set(causes(found)) == {"edited_reply"}
    assert edited.turns == edited.forks == 4 and edited.tokens_duplicated > 0
    assert edited.fix.startswith("harness: send each assistant message back exactly as received")
    first = edited.first_difference
    assert (first["edit"], first["turn"], first["message_index"]) == (edit, 1, 1)  # [user, reply, ...]
    assert (first["held_token"], first["rendered_token"]) == (held_token, sent_token)
    assert f"⟦{held_token}⟧" in first["held"] and "Hello" in first["held"]
    text = (tmp_path / "check" / "certificate.md").read_text()
    assert f"(the model's reply {edit}): the forest holds" in text and edited.fix in text
    assert "first at session" in (tmp_path / "run.log").read_text()


def test_an_agent_that_never_calls_the_model_is_broken(tmp_path: Path, tiny_path: Path) -> None:
    found = checked(tmp_path, tiny_path, "silent")
    assert found.verdict == cert.BROKEN and found.stage("sessions").verdict == cert.FAIL
    assert "no session committed a model turn" in found.stage("sessions").summary
    assert found.stage("template").verdict == cert.SKIPPED


def test_a_template_that_cannot_render_the_agents_messages_is_broken(tmp_path: Path, tiny_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    refuse = "{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('no tool role here') }}{%- endif %}"
    template = model / "chat_template.jinja"
    template.write_text(refuse + "{%- endfor %}\n" + template.read_text())
    found = checked(tmp_path, tiny_path, "verbatim", f"model.path={model}")
    assert found.verdict == cert.BROKEN and found.stage("template").verdict == cert.FAIL
    assert "no tool role here" in found.stage("template").summary


def test_an_unreachable_engine_is_broken(tmp_path: Path, tiny_path: Path) -> None:
    found = checked(tmp_path, tiny_path, "verbatim", "engine=sglang", "engine.urls=[http://127.0.0.1:9]")
    assert found.verdict == cert.BROKEN and "could not start" in found.stage("sessions").summary


def test_an_engine_that_fails_every_generation_is_broken(tmp_path: Path, tiny_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTY_ENGINE_FAIL_EVERY", "1")
    found = checked(tmp_path, tiny_path, "verbatim", "engine._target_=relax_pipeline.testing.faults.FaultyScriptEngine")
    assert found.verdict == cert.BROKEN and found.stage("sessions").verdict == cert.FAIL
    assert found.stage("sessions").evidence["errors"], "each session's error is listed"


@pytest.mark.parametrize("mode, status", [("malformed", 1), ("silent", 2)])
def test_the_cli_exits_with_the_verdict(tmp_path: Path, tiny_path: Path, mode: str, status: int) -> None:
    done = subprocess.run([sys.executable, "-m", "relax_pipeline", *overrides(tmp_path, tiny_path, mode)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == status, done.stderr[-2000:]
    assert "check: verdict" in (tmp_path / "run.log").read_text()


def test_an_unknown_parser_name_is_broken_before_any_session(tmp_path: Path, tiny_path: Path) -> None:
    """A parser name that does not exist is refused when the config is read (naming the key), so no certificate
    is written: the check exits with the broken status and the run log's last line says why."""
    done = subprocess.run([sys.executable, "-m", "relax_pipeline",
                           *overrides(tmp_path, tiny_path, "verbatim", "protocol.tool_call_parser=nope")],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == cert.EXIT_STATUS[cert.BROKEN], done.stderr[-2000:]
    last = (tmp_path / "run.log").read_text().strip().splitlines()[-1]
    assert "protocol.tool_call_parser='nope' is not built in" in last
