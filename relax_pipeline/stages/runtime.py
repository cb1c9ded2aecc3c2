"""Runtime stage: wait for a group's agents, read their outputs and match their exports.

Each agent runs under its active-time budget while the gateway serves its model calls. When an agent
exits, its output file is parsed and its exports are matched to committed states (implicit: the one
leaf of a linear history, or every chain of a forked one; explicit: every record). The first failure
(non-zero exit, timeout, bad output, export mismatch) marks that session `failed` with the reason,
terminates the group's other agents and drops the group (`dropped`, naming the failed session); nothing
is raised to the caller. An agent that fails right after our length limit cut its last turn is not a
failure: the session is exported implicitly and ends `truncated` (`Group.truncated` keeps the reason).
"""

from __future__ import annotations

import asyncio
import logging

from relax_pipeline.agent.launcher import AgentFailure
from relax_pipeline.agent.session_io import AgentOutputError, parse_output
from relax_pipeline.forest.export import IMPLICIT_MODES, Exported, ExportError, explicit_exports, implicit_exports
from relax_pipeline.stages.group import Group, drop_group
from relax_pipeline.turn.service import ForestStore, Session, Status

log = logging.getLogger(__name__)


class Runtime:
    """Waits for every agent of a group and turns their outputs into exported states."""

    def __init__(self, store: ForestStore, implicit: str = "leaves") -> None:
        self.store = store
        if implicit not in IMPLICIT_MODES:
            raise ValueError(f"export.implicit={implicit!r}; choose one of {list(IMPLICIT_MODES)}")
        self.implicit = implicit
        """`export.implicit`: `leaves` exports every chain of a forked session, `strict` refuses it."""

    async def run(self, group: Group) -> dict[str, list[Exported]]:
        """Exports per session id; empty when the group was dropped (see `group.dropped`)."""
        tasks = {s.id: asyncio.create_task(self._finish(group, s)) for s in group.sessions}
        exports: dict[str, list[Exported]] = {}
        for future in asyncio.as_completed(list(tasks.values())):
            session, result = await future
            if isinstance(result, str):
                await self._drop(group, session, result)
            else:
                exports[session.id] = result
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {} if group.dropped else exports

    async def _finish(self, group: Group, session: Session) -> tuple[Session, list[Exported] | str]:
        if session.status.terminal:
            return session, session.error or f"session {session.status.value}"
        try:
            await group.processes[session.id].wait()
            self.store.set_status(session, Status.EXITED)
            if session.lease is not None:
                session.lease.notify()
            output = parse_output(group.session_dir(session) / "output.json")
            group.outputs[session.id] = output
            if not output.implicit:
                return session, explicit_exports(session.forest, output.records)
            return session, implicit_exports(session.forest, self.implicit)
        except (AgentFailure, AgentOutputError) as error:
            return session, self._after_truncation(group, session, str(error))
        except ExportError as error:
            return session, str(error)
        except asyncio.CancelledError:
            return session, "cancelled"

    def _after_truncation(self, group: Group, session: Session, reason: str) -> list[Exported] | str:
        """An agent that failed after our length limit cut its last turn (Claude Code, Codex and others stop
        with an error on `length`) ends `truncated`, not failed: its committed history is exported implicitly
        and scored by the reward model or `credit.truncated_reward`. Any other failure stays a failure."""
        last = next((n for n in reversed(session.forest.nodes) if n.kind == "response"), None)
        if last is None or last.finish_reason != "length":
            return reason
        try:
            exported = implicit_exports(session.forest, self.implicit)
        except ExportError as error:
            return f"{reason}; and its history cannot be exported: {error}"
        group.truncated[session.id] = reason
        log.info("session %s: the agent failed after its turn %d hit the length limit; recorded as truncated (%s)",
                 session.id, session.forest.turn_count, reason.splitlines()[0] if reason else "")
        return exported

    async def _drop(self, group: Group, session: Session, reason: str) -> None:
        """The first failure fails its session and drops the group; the group's agents are terminated."""
        drop_group(self.store, group, reason, session if group.dropped is None else None)
        await asyncio.gather(*(p.terminate() for p in group.processes.values()))
