"""The certificate (`certify/certificate.py`): the schema round-trips through its JSON file, stages are listed in
order (those not run as skipped), and the verdict and exit status follow the stages and causes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_pipeline.certify import certificate as c

SETUP = {"model": "tiny", "rollout.history": "render", "export.implicit": "leaves", "sessions": 2}


def cause(name: str, duplicated: int = 0, lost: int = 0, fix: str = "") -> c.Cause:
    return c.Cause(name, turns=2, forks=1 if duplicated or lost else 0, tokens_duplicated=duplicated,
                   tokens_lost=lost, share=(duplicated + lost) / 100, fix=fix)


def test_the_schema_round_trips_through_its_files(tmp_path: Path) -> None:
    stages = [c.Stage("config", c.PASS, "ok", {"resident_sessions": 4}),
              c.Stage("template", c.WARN, "1 drift", {"turns": [{"cause": "reasoning_dropped", "held": "⟦<think>⟧"}]})]
    cert = c.certificate(stages, [cause("reasoning_dropped", 40, fix="rollout.history=tokens")], SETUP)
    folder = c.write(cert, tmp_path)
    assert c.read(tmp_path) == cert and c.Certificate.from_dict(json.loads(json.dumps(cert.as_dict()))) == cert
    assert json.loads((folder / "certificate.json").read_text())["version"] == c.VERSION
    text = (folder / "certificate.md").read_text()
    assert "**degraded**" in text and "rollout.history=tokens" in text and "### forks: skipped" in text
    assert [s.name for s in cert.stages] == list(c.STAGES)


def test_another_version_is_refused() -> None:
    data = c.certificate([], [], SETUP).as_dict() | {"version": 99}
    with pytest.raises(ValueError, match="version 99 is not one of"):
        c.Certificate.from_dict(data)


def test_a_version_1_certificate_still_reads() -> None:
    """Version 1 had no `Cause.first_difference` (version 2 added it with the cause edited_reply)."""
    data = c.certificate([], [cause("whitespace", 10, fix="harness: x")], SETUP).as_dict() | {"version": 1}
    for written in data["causes"]:
        del written["first_difference"]
    read = c.Certificate.from_dict(data)
    assert read.version == 1 and read.causes[0].first_difference == {} and read.causes[0].cause == "whitespace"


def test_the_markdown_shows_each_causes_first_differing_token_and_edit(tmp_path: Path) -> None:
    where = {"session": "sess-1", "turn": 1, "cause": "edited_reply", "held": "x⟦Hello⟧ there",
             "rendered": "x⟦he⟧llo there", "held_token": "Hello", "rendered_token": "he", "edit": "re-cased"}
    edited = c.Cause("edited_reply", 1, 1, 15, 0, 0.1, "harness: send it back as received", where)
    text = c.markdown(c.certificate([c.Stage("config", c.PASS, "")], [edited], SETUP))
    line = next(x for x in text.splitlines() if x.startswith("- **edited_reply**"))
    assert "first at session sess-1 turn 1 (the model's reply re-cased)" in line
    assert 'holds `"Hello"`' in line and 'renders `"he"`' in line
    assert c.Certificate.from_dict(json.loads(json.dumps(c.certificate([], [edited], SETUP).as_dict()))).causes == (
        edited,)


@pytest.mark.parametrize("stages, causes, verdict", [
    ([c.Stage("config", c.PASS, "")], [cause("tool_arguments_reserialized")], c.TRAINING_GRADE),
    ([c.Stage("config", c.PASS, ""), c.Stage("parsers", c.WARN, "")], [], c.TRAINING_GRADE),
    ([c.Stage("config", c.PASS, "")], [cause("reasoning_dropped", duplicated=10)], c.DEGRADED),
    ([c.Stage("config", c.PASS, "")], [cause("system_prompt_changed", lost=10)], c.DEGRADED),
    ([c.Stage("config", c.PASS, "")], [cause("unknown")], c.TRAINING_GRADE),
    ([c.Stage("config", c.PASS, "")], [c.Cause("unknown", 1, 1, 0, 0, 0.0, "")], c.DEGRADED),
    ([c.Stage("config", c.PASS, "")], [cause("tool_arguments_malformed")], c.DEGRADED),
    ([c.Stage("config", c.PASS, ""), c.Stage("sessions", c.FAIL, "no model call")], [cause("unknown")], c.BROKEN),
])
def test_the_verdict_and_exit_status(stages: list[c.Stage], causes: list[c.Cause], verdict: str) -> None:
    cert = c.certificate(stages, causes, SETUP)
    assert cert.verdict == verdict and cert.exit_status == {"training-grade": 0, "degraded": 1, "broken": 2}[verdict]
