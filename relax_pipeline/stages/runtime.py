"""Runtime stage: wait for a group's agents, read their outputs and match their exports.

Each agent runs under its active-time budget while the gateway serves its model calls. When an agent
exits, its output file is parsed and its exports are matched to committed states (implicit: the one
leaf of a linear history; explicit: every record). The first failure (non-zero exit, timeout, bad
output, export mismatch) marks that session `failed` with the reason, terminates the group's other
agents and drops the group (`dropped`, naming the failed session); nothing is raised to the caller.
"""

from __future__ import annotations

import asyncio
import logging

from relax_pipeline.agent.launcher import AgentFailure
from relax_pipeline.agent.session_io import AgentOutputError, parse_output
from relax_pipeline.forest.export import Exported, ExportError, explicit_exports, implicit_export
from relax_pipeline.stages.group import Group, drop_group
from relax_pipeline.turn.sessions import ForestStore, Session, Status

log = logging.getLogger(__name__)


class Runtime:
    """Waits for every agent of a group and turns their outputs into exported states."""

    def __init__(self, store: ForestStore) -> None:
        self.store = store

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
            exported = explicit_exports(session.forest, output.records) if not output.implicit else [
                implicit_export(session.forest)]
            return session, exported
        except (AgentFailure, AgentOutputError, ExportError) as error:
            return session, str(error)
        except asyncio.CancelledError:
            return session, "cancelled"

    async def _drop(self, group: Group, session: Session, reason: str) -> None:
        """The first failure fails its session and drops the group; the group's agents are terminated."""
        drop_group(self.store, group, reason, session if group.dropped is None else None)
        await asyncio.gather(*(p.terminate() for p in group.processes.values()))
