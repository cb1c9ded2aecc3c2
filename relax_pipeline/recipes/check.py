"""`job=check`: validate the config, the model, the dataset and the agent setup, then certify real sessions.

The recipe: the run's plan (`parts.Plan`) and its engine (not started), the findings logged (what would run), any
problem that would stop the run raised; then, with `check.sessions` above 0, that many real sessions of the
configured agent through the engine, the gateway, the services and the pipeline, examined turn by turn
(`relax_pipeline/certify/`); the certificate written (`check/certificate.json` and `.md`) and its verdict returned
as `check/exit_status`. An engine or a service that cannot start is the certificate's verdict, not a failure of
the run. Everything started is closed at the end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from relax_pipeline.certify.certificate import Cause, Stage
from relax_pipeline.certify.check import CheckKeys, certify_sessions, conclude, config_stage, start_failed
from relax_pipeline.certify.evidence import RuntimeKeys
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.engine.base import Engine
from relax_pipeline.recipes.parts import Job, Plan, Teardown, agent_problems, engine_of, pipeline_of, serve

log = logging.getLogger("relax_pipeline")


def run(job: Job) -> dict[str, float]:
    """The check's findings and the certificate's verdict (`check/exit_status`)."""
    return asyncio.run(check(job))


async def check(job: Job) -> dict[str, float]:
    plan = Plan.of(job.config, job.folder)
    async with Teardown(plan) as teardown:
        teardown.engine = engine = engine_of(plan)
        found = findings(plan)
        report(plan, found)
        stages, causes = [config_stage(found, plan.slot_plan().lines())], []
        if job.config.check.sessions > 0:
            certified, causes = await _certify_sessions(plan, engine, teardown)
            stages += certified
        cert = conclude(stages, causes, setup(plan), job.folder)
        return {"check/problems": 0.0, "check/dataset_rows": float(len(plan.dataset)),
                "check/resident_sessions": float(found["resident_sessions"]),
                "check/required_slots": float(plan.slot_plan().required), "check/exit_status": float(cert.exit_status)}


def findings(plan: Plan) -> dict[str, Any]:
    """What would run."""
    return {
        "model": str(plan.model_path), "dataset_rows": len(plan.dataset),
        "agent_command": plan.agents.train.command, "agent_services": [s.name for s in plan.services.specs],
        "resident_groups": plan.capacity.groups,
        "resident_sessions": plan.capacity.sessions, "max_context_len": plan.context_len,
        "eval_datasets": {s.name: len(s.dataset) for s in plan.eval_sets},
    }


def report(plan: Plan, found: dict[str, Any]) -> None:
    """Log the findings, the slot plan and every problem; raise the first problem (it stops any run)."""
    problems = agent_problems(plan.agents)
    for key, value in found.items():
        log.info("check: %s = %s", key, value)
    for line in plan.slot_plan().lines():
        log.info("check: slots: %s", line)
    for problem in problems:
        log.warning("check: problem: %s", problem)
    if problems:
        raise ValueError(problems[0])
    log.info("check: OK")


def setup(plan: Plan) -> dict[str, Any]:
    """The certificate's record of what was checked."""
    c = plan.config
    return {"model": str(plan.model_path), "agent": plan.agents.train.command, "engine": c.engine._target_,
            "reasoning_parser": c.protocol.reasoning_parser, "tool_call_parser": c.protocol.tool_call_parser,
            "rollout.history": c.rollout.history, "export.implicit": c.export.implicit,
            "check.sessions": c.check.sessions}


async def _certify_sessions(plan: Plan, engine: Engine, teardown: Teardown) -> tuple[list[Stage], list[Cause]]:
    """`check.sessions` sessions through the run's engine, gateway, services and pipeline (`certify/`)."""
    c = plan.config
    try:
        served = await serve(plan, engine, teardown)
        await plan.services.start()
    except Exception as error:  # noqa: BLE001 - an engine that cannot start is the check's verdict
        return [start_failed(error)], []
    template = ChatTemplate(engine.tokenizer, plan.model.end_of_turn)
    runtime = RuntimeKeys(c.agent.timeout, type(plan.strategy).__name__, c.credit.rm_path is not None)
    keys = CheckKeys(c.check.sessions, c.rollout.history, c.export.implicit, runtime)
    return await certify_sessions(pipeline_of(plan, served), template, c.protocol.parser(), keys)
