"""Runtime stage: wait for a group's agents, read their outputs and match their exports.

Each agent runs under its active-time budget while the gateway serves its model calls. When an agent
exits, its output file is parsed and its exports are matched to committed states (implicit: the one
leaf of a linear history, or every chain of a forked one; explicit: every record). The first failure
(non-zero exit, timeout, bad output, export mismatch) marks that session `failed` with the reason and its
outcome (`agent_error`, `timeout`, `infra_error`: `stages/group.py`; an agent that fails after the gateway
answered one of its turns with a 500 is an `infra_error`), terminates the group's other agents and
drops the group (`dropped`, naming the failed session); nothing is raised to the caller.

An agent that fails right after the pipeline's own budget cut its last turn (the turn used all of
`rollout.max_response_len`, or of `eval.max_response_len`, or of the room the context limit left) is not a
failure: the session is exported implicitly and ends `truncated`, the failure kept in `Group.truncated` (and
so in the dump row's `error`). Not when the agent's own request `max_tokens` cut the turn (its failure is its
own), not after a timeout, and not in a group already dropped (an interrupted run's agents fail as they end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from relax_pipeline.agent.launcher import AgentFailure
from relax_pipeline.agent.session_io import AgentOutputError, parse_output
from relax_pipeline.forest.export import Exported, ExportError, explicit_exports, implicit_exports
from relax_pipeline.forest.store import Node, SessionForest
from relax_pipeline.stages.group import AGENT_ERROR, INFRA_ERROR, Group, drop_group
from relax_pipeline.stages.settings import ExportSettings
from relax_pipeline.turn.records import SamplingDefaults
from relax_pipeline.turn.sessions import ForestStore, Session, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionFailure:
    """Why a session failed and its outcome; connects `Runtime._finish` to `drop_group`."""

    reason: str
    outcome: str = AGENT_ERROR


class Runtime:
    """Waits for every agent of a group and turns their outputs into exported states."""

    def __init__(self, store: ForestStore, export: ExportSettings | None = None,
                 budgets: Mapping[str, SamplingDefaults] | None = None) -> None:
        self.store = store
        self.implicit = (export or ExportSettings()).implicit
        """`export.implicit`: `leaves` exports every chain of a forked session, `strict` refuses it."""
        self.budgets = dict(budgets or {})
        """The turn budget per session mode (`train`, `eval`): what tells the pipeline's length cut from the agent's
        own `max_tokens`. Without one for a mode, no failure after a cut turn is recorded as truncated."""

    async def run(self, group: Group, on_session_end: Callable[[Session], None] | None = None
                  ) -> dict[str, list[Exported]]:
        """Exports per session id; empty when the group was dropped (see `group.dropped`). `on_session_end` sees
        each session once its agent is done (exited, failed or never started), as they come."""
        tasks = {s.id: asyncio.create_task(self._finish(group, s)) for s in group.sessions}
        exports: dict[str, list[Exported]] = {}
        for future in asyncio.as_completed(list(tasks.values())):
            session, result = await future
            if on_session_end is not None:
                on_session_end(session)
            if isinstance(result, SessionFailure):
                await self._drop(group, session, result)
            else:
                exports[session.id] = result
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {} if group.dropped else exports

    async def _finish(self, group: Group, session: Session) -> tuple[Session, list[Exported] | SessionFailure]:
        if session.status.terminal:  # failed at start (Prepare), or dropped before its agent ended
            return session, SessionFailure(session.error or f"session {session.status.value}", INFRA_ERROR)
        try:
            await group.processes[session.id].wait()
            self.store.set_status(session, Status.EXITED)
            if session.lease is not None:
                session.lease.notify()
            output = parse_output(group.session_dir(session) / "output.json")
            group.outputs[session.id] = output
            if not output.implicit:
                exports = explicit_exports(session.forest, output.records)
            else:
                exports = implicit_exports(session.forest, self.implicit)
            session.mark("exported")  # the `export` span of its trace (stages/traces.py)
            return session, exports
        except AgentFailure as error:
            return session, self._after_truncation(group, session, _failure(session, error))
        except AgentOutputError as error:
            return session, self._after_truncation(group, session, SessionFailure(str(error)))
        except ExportError as error:
            return session, SessionFailure(str(error))
        except asyncio.CancelledError:
            return session, SessionFailure("cancelled", INFRA_ERROR)

    def _after_truncation(self, group: Group, session: Session,
                          failure: SessionFailure) -> list[Exported] | SessionFailure:
        """An agent that failed after the pipeline's budget cut its last turn (Claude Code, Codex and others stop
        with an error on `length`) ends `truncated`, not failed: its committed history is exported implicitly
        and scored by the reward model or `credit.truncated_reward`. Any other failure stays a failure."""
        if failure.outcome != AGENT_ERROR or group.dropped or not self._budget_cut(session):
            return failure
        try:
            exported = implicit_exports(session.forest, self.implicit)
        except ExportError as error:
            return SessionFailure(f"{failure.reason}; and its history cannot be exported: {error}")
        group.truncated[session.id] = failure.reason
        log.info("session %s: the agent failed after its turn %d was cut by rollout.max_response_len or the "
                 "context limit; recorded as truncated (%s)", session.id, session.forest.turn_count,
                 failure.reason.splitlines()[0] if failure.reason else "")
        return exported

    def _budget_cut(self, session: Session) -> bool:
        """True when the session's last turn ended on `length` having used the pipeline's whole budget."""
        last = next((n for n in reversed(session.forest.nodes) if n.kind == "response"), None)
        budget = self.budgets.get(session.mode)
        if last is None or last.finish_reason != "length" or budget is None:
            return False
        limit = last.sampling.max_new_tokens if last.sampling is not None else len(last.token_ids)
        return limit >= pipeline_budget(session.forest, last, budget)

    async def _drop(self, group: Group, session: Session, failure: SessionFailure) -> None:
        """The first failure fails its session and drops the group; the group's agents are terminated."""
        drop_group(self.store, group, failure.reason, session if group.dropped is None else None, failure.outcome)
        await asyncio.gather(*(p.terminate() for p in group.processes.values()))


def _failure(session: Session, error: AgentFailure) -> SessionFailure:
    """The agent's failure; an `infra_error` when the pipeline failed one of its turns first (an HTTP 500: the
    gateway marks the session `turn_failed`), so an engine failure is never counted as the agent's."""
    if error.kind == AGENT_ERROR and "turn_failed" in session.timing:
        return SessionFailure(f"{error}\n(the pipeline failed one of its turns first: HTTP 500, see run.log)",
                              INFRA_ERROR)
    return SessionFailure(str(error), error.kind)


def pipeline_budget(forest: SessionForest, response: Node, budget: SamplingDefaults) -> int:
    """The most tokens the pipeline let `response`'s turn generate: the response length limit, or the room the
    context limit left after its prompt (the expanded training ids, as the turn service counts them)."""
    prompt = sum(len(node.training_ids) for node in forest.lineage(response)[:-1])
    return min(budget.max_response_len, budget.max_context_len - prompt)
