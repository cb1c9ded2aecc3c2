"""`RemoteAgent`: what every executor whose agent runs elsewhere shares (`http_executor`, `ray_executor`).

A remote session is one asyncio task (a POST to an agent server, a call to a Ray node) that ends with the agent's
exit code, the text of its output file and the tail of its log. This base keeps the local agent's contract
(`turn.leases.AgentRun`): `start` notes the session's local paths and starts the task under an `ActiveTimer`;
`wait` waits with `wait_active` (paused while the group lease is not held), ends the session on timeout or
cancellation (`terminate`, the subclass's), and writes the answer locally: the output text to the session's
`RELAX_OUTPUT_JSON`, the log to `<io_dir>/agent.log`, so output parsing, reward and dump are the same as for a
local process. Failures are `AgentFailure`s with the reason and the log tail.

Subclasses say how to start the task, how to read its answer (`_answer`), how to end it (`terminate`, `kill`)
and what ending it did (`_ended`, for the messages). Not here: any wire or cluster detail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

from relax_pipeline.agent.launcher import (
    LOG_NAME,
    ActiveTimer,
    AgentExit,
    AgentFailure,
    AgentSpec,
    log_tail,
    wait_active,
)


class RemoteAgent:
    """One session whose agent runs elsewhere; the subclass runs the task and reads its answer."""

    def __init__(self, spec: AgentSpec) -> None:
        self.spec = spec
        self.timer = ActiveTimer(spec.timeout)
        self._task: asyncio.Task[Any] | None = None
        self._session_id = ""
        self._log_path: Path | None = None
        self._output_path: Path | None = None
        self._exit_code: int | None = None
        self._started_at = 0.0

    @property
    def pid(self) -> int | None:
        """Always None: the process runs elsewhere."""
        return None

    @property
    def returncode(self) -> int | None:
        """The exit code the remote side reported, None while the session runs."""
        return self._exit_code

    def _open(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Note the session's id and local paths; refuse a second start."""
        if self._task is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice; use one per session")
        io_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = io_dir / LOG_NAME
        self._output_path = Path(session_env.get("RELAX_OUTPUT_JSON") or io_dir / "output.json")
        self._session_id = session_env["RELAX_SESSION_ID"]

    def _launch(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run the session's task and start its active-time clock."""
        self._started_at = time.monotonic()
        self._task = asyncio.create_task(work)
        self.timer.start()

    def _input_text(self, session_env: Mapping[str, str]) -> str:
        """The session's input file; an unreadable one is an `AgentFailure`."""
        path = session_env.get("RELAX_INPUT_JSON")
        try:
            return Path(path).read_text() if path else "{}"
        except OSError as error:
            raise AgentFailure(f"could not read the input file {path} ({error})", None, "", self._log_path) from error

    async def wait(self) -> AgentExit:
        """Wait for the answer under the active timer; raise `AgentFailure` unless the agent exited 0."""
        task = self._require_started()
        try:
            finished = await wait_active(self.timer, task)
        except asyncio.CancelledError:
            await asyncio.shield(self.terminate())
            raise
        if not finished:
            await self.terminate()
            raise self._failure(f"timed out after {self.timer.budget:g} s of active time ({self._ended()})", None)
        if task.cancelled():
            raise self._failure(f"cancelled: the session was dropped ({self._ended()})", None)
        return self._finish(*self._answer(task))

    def _finish(self, code: int | None, output: str, text: str, reason: str | None) -> AgentExit:
        """Write the answer locally; AgentExit for exit 0, else an `AgentFailure` with `reason`."""
        self._exit_code = code
        self._note(text)
        if output:
            assert self._output_path is not None
            self._output_path.parent.mkdir(parents=True, exist_ok=True)
            self._output_path.write_text(output)
        if reason is not None:
            raise self._failure(reason, code)
        return AgentExit(exit_code=0, elapsed_s=time.monotonic() - self._started_at, active_s=self.timer.elapsed())

    def _answer(self, task: asyncio.Task[Any]) -> tuple[int | None, str, str, str | None]:
        """(exit code, output text, log text, failure reason or None) of a finished task; raise for no answer."""
        raise NotImplementedError

    def _ended(self) -> str:
        """What ending the session did, for the timeout and cancellation messages."""
        raise NotImplementedError

    async def terminate(self) -> None:
        raise NotImplementedError

    def tail(self) -> str:
        """The last `log_tail_bytes` of agent.log (the remote log and this executor's notes)."""
        return log_tail(self._log_path, self.spec.log_tail_bytes)

    def _note(self, text: str) -> None:
        """Append `text` to agent.log."""
        if self._log_path is not None and text:
            with open(self._log_path, "a", encoding="utf-8", errors="replace") as file:
                file.write(text if text.endswith("\n") else text + "\n")

    def _failure(self, reason: str, exit_code: int | None) -> AgentFailure:
        return AgentFailure(reason, exit_code, self.tail(), self._log_path)

    def _require_started(self) -> asyncio.Task[Any]:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.wait() before start(); call start() first")
        return self._task
