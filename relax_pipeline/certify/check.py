"""`job=check check.sessions=N`: N real sessions of the configured agent examined stage by stage into a certificate.

The check recipe (`recipes/check.py`) builds the run's objects, checks the config as before (its findings are the
`config` stage), starts the engine, gateway and agent services, and calls `certify_sessions` with the run's
pipeline, the model's chat template and the configured output parser; `conclude` writes `check/certificate.json` and
`check/certificate.md` (`certify/certificate.py`) and logs the verdict. Stages after `sessions` run only when a
session committed a turn; a stage that fails (`certify/evidence.py`, `certify/examine.py`) makes the app `broken`.
Nothing here raises for what the sessions did: an agent that never calls the model, a template that cannot render
its messages, an engine that cannot answer are each a failed stage with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_pipeline.certify.certificate import FAIL, PASS, Cause, Certificate, Stage, certificate, first_token, write
from relax_pipeline.certify.evidence import (
    RuntimeKeys,
    export_stage,
    parsers_stage,
    runtime_stage,
    sessions_stage,
    unanswered_stage,
)
from relax_pipeline.certify.examine import Causes, template_and_forks
from relax_pipeline.certify.sessions import run_sessions
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.stages.pipeline import Pipeline

log = logging.getLogger("relax_pipeline")


@dataclass(frozen=True)
class CheckKeys:
    """What the check runs and measures against; connects the check recipe's config to `certify_sessions`."""

    sessions: int
    """`check.sessions`."""
    history: str
    """`rollout.history`."""
    implicit: str
    """`export.implicit`."""
    runtime: RuntimeKeys


def config_stage(findings: dict[str, Any], slot_lines: list[str]) -> Stage:
    """Today's checks of `job=check` (they passed: a problem stops the run before this) as the first stage."""
    return Stage("config", PASS, "config, model, dataset, agent folder and services check out",
                 {**findings, "slots": slot_lines})


def start_failed(error: BaseException) -> Stage:
    """The sessions stage when the engine, gateway or agent services could not start."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return Stage("sessions", FAIL, f"the engine, gateway or agent services could not start: {text}")


async def certify_sessions(pipeline: Pipeline, template: ChatTemplate, parser: OutputParser, keys: CheckKeys
                           ) -> tuple[list[Stage], list[Cause]]:
    """Run `keys.sessions` sessions and examine them: the stages after `config`, and the causes of drift."""
    runs = await run_sessions(pipeline, keys.sessions)
    stages = [sessions_stage(runs)]
    unrendered = unanswered_stage(runs, template)
    if unrendered is not None:
        return [*stages, unrendered], []
    if stages[0].verdict == FAIL:
        return stages, []
    causes = Causes(keys.history, keys.implicit)
    stages += template_and_forks(runs, template, causes)
    if stages[-1].verdict == FAIL:
        return stages, []
    stages += [parsers_stage(runs, template, parser), export_stage(runs, keys.runtime),
               runtime_stage(runs, keys.runtime)]
    return stages, causes.causes()


def conclude(stages: list[Stage], causes: list[Cause], setup: dict[str, Any], output_dir: Path) -> Certificate:
    """The certificate of these stages, written to `check/` and logged (one line per stage, then the verdict)."""
    cert = certificate(stages, causes, setup)
    folder = write(cert, output_dir)
    for stage in cert.stages:
        log.info("check: %s: %s: %s", stage.name, stage.verdict, stage.summary)
    for cause in cert.causes:
        where = f"; {first_token(cause)}" if cause.first_difference else ""
        log.info("check: cause %s: %d turns, %d forks, %d tokens duplicated, %d lost (%.1f%%)%s%s", cause.cause,
                 cause.turns, cause.forks, cause.tokens_duplicated, cause.tokens_lost, 100 * cause.share, where,
                 f"; fix: {cause.fix}" if cause.fix else "")
    log.info("check: verdict %s (exit status %d): %s", cert.verdict, cert.exit_status, folder / "certificate.md")
    return cert
