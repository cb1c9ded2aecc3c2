"""The certificate `job=check` writes: stage verdicts with their evidence, the named causes, one overall verdict.

Files, in the run's output folder: `check/certificate.json` (this schema, `version` 2) and `check/certificate.md`
(the same, for a person). The schema, field by field, is the docstrings of `Certificate`, `Stage` and `Cause`;
`Certificate.from_dict(c.as_dict()) == c` for every certificate. Version 2 added the cause `edited_reply` and
`Cause.first_difference`; a version 1 file still reads (its causes without a first difference).

Overall verdict (`verdict_of`): `broken` when a stage failed (the agent never called the model, the template
cannot render its messages, a parser name does not exist, the engine cannot be reached, nothing exportable);
`degraded` when a drift forked a session (a fork re-processes a shared prefix or, under `export.implicit=strict`,
loses the session), or when the agent re-sends malformed tool arguments; `training-grade` otherwise (no fork, no
token lost: drift the forest absorbed is listed with its cause, and leaves the data exactly what the model saw).
Exit status 0, 1, 2 for the three (`EXIT_STATUS`), which `python -m relax_pipeline job=check` exits with. This
module runs no session and reads no forest (`certify/examine.py` does).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERSION = 2
READS = (1, 2)
"""The schema versions `Certificate.from_dict` reads (1 lacks `Cause.first_difference`)."""
TRAINING_GRADE, DEGRADED, BROKEN = "training-grade", "degraded", "broken"
EXIT_STATUS = {TRAINING_GRADE: 0, DEGRADED: 1, BROKEN: 2}
"""The process exit status of `job=check` for each verdict."""
PASS, WARN, FAIL, SKIPPED = "pass", "warn", "fail", "skipped"
STAGE_VERDICTS = (PASS, WARN, FAIL, SKIPPED)
STAGES = ("config", "sessions", "template", "forks", "parsers", "export", "runtime")
"""The stages in the order they run and are listed."""
FOLDER = "check"


@dataclass(frozen=True)
class Stage:
    """One stage of the check and what it found; connects `certify/examine.py` to the certificate."""

    name: str
    """One of `STAGES`."""
    verdict: str
    """pass, warn (evidence worth reading, verdict unchanged), fail (the app is broken), skipped (an earlier
    stage failed)."""
    summary: str
    """One sentence: what was checked and what came out, or why it failed."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Counts, per-turn records and the first differences that back the verdict (JSON values)."""


@dataclass(frozen=True)
class Cause:
    """One cause of drift over all checked turns, what it costs and the switch that fixes it."""

    cause: str
    """One of `certify.drift.CAUSES`."""
    turns: int
    """Turns whose re-sent history drifted for this cause."""
    forks: int
    """Of those, turns that forked the session (the rest were absorbed: the forest kept the model's tokens)."""
    tokens_duplicated: int
    """Tokens exported more than once because of these forks (a shared prefix processed again per chain)."""
    tokens_lost: int
    """Generated tokens no exported sample trains because of these forks (`export.implicit=strict`)."""
    share: float
    """(duplicated + lost) / all tokens the sessions exported once: the share of the data this cause costs."""
    fix: str
    """The key or harness switch that fixes it ('' when nothing needs fixing)."""
    first_difference: dict[str, Any] = field(default_factory=dict)
    """The first turn that drifted for this cause: `session`, `turn`, and where its re-render first leaves the held
    tokens (`certify.drift.Drift.as_dict`: both sides decoded with the differing token as ⟦…⟧, `held_token`,
    `rendered_token`, and `edit` for an edited reply); {} when no turn of it was placed (a fork seen only in the
    forest's fork record)."""

    @property
    def costly(self) -> bool:
        return self.tokens_duplicated > 0 or self.tokens_lost > 0


@dataclass(frozen=True)
class Certificate:
    """Is this agent app (agent × model × template × parsers) training-grade? The answer and its evidence."""

    verdict: str
    """training-grade, degraded or broken (`verdict_of`)."""
    stages: tuple[Stage, ...]
    causes: tuple[Cause, ...] = ()
    """Every cause of drift seen, costly or absorbed."""
    setup: dict[str, Any] = field(default_factory=dict)
    """What was certified: model, agent command, engine, template source, parsers, rollout.history,
    export.implicit, sessions asked for."""
    version: int = VERSION

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Certificate:
        if data.get("version") not in READS:
            raise ValueError(f"certificate version {data.get('version')!r} is not one of {READS}: "
                             "re-run job=check with this relax_pipeline to write a current one")
        return cls(data["verdict"], tuple(Stage(**s) for s in data["stages"]),
                   tuple(Cause(**c) for c in data["causes"]), data["setup"], data["version"])


def verdict_of(stages: tuple[Stage, ...], causes: tuple[Cause, ...]) -> str:
    """broken when a stage failed; degraded when a cause forked a session (whatever it costs) or is malformed tool
    arguments; training-grade otherwise (drift the forest absorbed, known or not, leaves the data exact)."""
    if any(s.verdict == FAIL for s in stages):
        return BROKEN
    if any(c.costly or c.forks or c.cause == "tool_arguments_malformed" for c in causes):
        return DEGRADED
    return TRAINING_GRADE


def certificate(stages: list[Stage], causes: list[Cause], setup: dict[str, Any]) -> Certificate:
    """A certificate of `stages` (those not run listed as skipped) with its verdict."""
    ran = {s.name for s in stages}
    listed = tuple(stages) + tuple(Stage(n, SKIPPED, "not run: an earlier stage failed") for n in STAGES
                                   if n not in ran)
    ordered = tuple(sorted(listed, key=lambda s: STAGES.index(s.name)))
    return Certificate(verdict_of(ordered, tuple(causes)), ordered, tuple(causes), setup)


def write(cert: Certificate, output_dir: Path) -> Path:
    """Write `check/certificate.json` and `check/certificate.md` under `output_dir`; returns the folder."""
    folder = output_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "certificate.json").write_text(json.dumps(cert.as_dict(), indent=2, ensure_ascii=False) + "\n")
    (folder / "certificate.md").write_text(markdown(cert))
    return folder


def read(output_dir: Path) -> Certificate:
    return Certificate.from_dict(json.loads((output_dir / FOLDER / "certificate.json").read_text()))


def markdown(cert: Certificate) -> str:
    """The certificate for a person: verdict, causes with their fixes, each stage with its evidence."""
    lines = [f"# Agent app certificate: **{cert.verdict}** (exit status {cert.exit_status})", ""]
    lines += [f"- {key}: `{value}`" for key, value in cert.setup.items()] + [""]
    if cert.causes:
        lines += ["## Causes", "", "| cause | turns | forks | tokens duplicated | tokens lost | share | fix |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c.cause} | {c.turns} | {c.forks} | {c.tokens_duplicated} | {c.tokens_lost} | "
                  f"{c.share:.1%} | {c.fix or '-'} |" for c in cert.causes]
        lines += [""] + [line for c in cert.causes if (line := _first_difference(c))] + [""]
    lines += ["## Stages", ""]
    for stage in cert.stages:
        lines += [f"### {stage.name}: {stage.verdict}", "", stage.summary, ""]
        if stage.evidence:
            lines += ["```json", json.dumps(stage.evidence, indent=2, ensure_ascii=False)[:6000], "```", ""]
    return "\n".join(lines)


def _first_difference(cause: Cause) -> str:
    """One list item: where the cause's first turn leaves the held tokens, the two tokens decoded."""
    d = cause.first_difference
    if not d:
        return ""
    return (f"- **{cause.cause}**: {first_token(cause)}; held {_quoted(d.get('held'))} vs sent "
            f"{_quoted(d.get('rendered'))}")


def first_token(cause: Cause) -> str:
    """Where the cause first shows, the two tokens decoded (`session sess-… turn 1 (the model's reply re-cased): the
    forest holds "Hello", the agent's history renders "he"`); '' when no turn of it was placed."""
    d = cause.first_difference
    if not d:
        return ""
    edit = f" (the model's reply {d['edit']})" if d.get("edit") else ""
    return (f"first at session {d.get('session')} turn {d.get('turn')}{edit}: the forest holds "
            f"{_quoted(d.get('held_token'))}, the agent's history renders {_quoted(d.get('rendered_token'))}")


def _quoted(text: object) -> str:
    return "nothing" if text is None else "`" + json.dumps(text, ensure_ascii=False).replace("`", "'") + "`"
