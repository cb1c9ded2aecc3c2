"""`agent.executor=http`: one session sent to an agent server over HTTP, waited on like a local process.

The wire contract (docs/agentic-rollout.md copies it):

- `POST {server_url}/sessions` with the JSON body
  `{"session_id": str, "env": {...}, "input": {...}, "timeout": float | null, "sandbox": {...}}`:
  `env` is `agent.env` plus the session's `RELAX_BASE_URL`, `RELAX_API_KEY`, `RELAX_MODEL`,
  `RELAX_SESSION_ID`, `RELAX_ROLLOUT_MODE` and `RELAX_GROUP_ID` (the file paths `RELAX_INPUT_JSON`,
  `RELAX_OUTPUT_JSON` and `RELAX_SESSION_IO_DIR` are local to the pipeline and are not sent: the input
  file's JSON travels as `input`); `timeout` is `agent.timeout`, the session's active-time budget (the
  pipeline enforces it, see below; a server may use it as a hint); `sandbox` is the run's `sandbox.*`
  limits for the code the server runs. The request stays open while the session runs; the server answers
  `200 {"exit_code": int, "output": str, "log": str}` when the agent is done: `output` is the text the
  agent would have written to its output file (may be empty: implicit export), `log` the tail of its log.
- `DELETE {server_url}/sessions/{session_id}` cancels a running session: the server ends its process tree
  and sandbox. Sent when the active-time budget runs out and when the session is dropped or cancelled.
- `GET {server_url}/health` answers 2xx when the server takes sessions (`agent.services` polls it).

`HttpAgent` keeps the local agent's contract (`turn.leases.AgentRun`): the returned `output` is written
to the session's local `RELAX_OUTPUT_JSON` and `log` to `<io_dir>/agent.log`, so output parsing, reward and
dump are unchanged. The budget counts active time with the same wait as `AgentProcess` (`wait_active`:
paused while the group lease is not held). A connection error, a non-200 answer, a malformed body, an
`exit_code` other than 0 and a timeout raise `AgentFailure` with the reason and the log tail.

Not done here: starting the server (`agent.services`), retrying a failed POST (a session is not idempotent),
and sandboxing (the server applies `sandbox`; `agent/sandbox.py` is the one our example uses).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from relax_pipeline.agent.launcher import AgentFailure, AgentSpec
from relax_pipeline.agent.remote import RemoteAgent

log = logging.getLogger(__name__)

SESSION_VARIABLES = ("RELAX_BASE_URL", "RELAX_API_KEY", "RELAX_MODEL", "RELAX_SESSION_ID", "RELAX_ROLLOUT_MODE",
                     "RELAX_GROUP_ID")
"""The session's RELAX_* variables sent as `env` (the file-path variables stay local)."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to open a connection to the agent server; the POST then waits as long as the session runs."""


class HttpAgent(RemoteAgent):
    """One session run by the agent server at `AgentSpec.server_url`: start it, wait on it under the active
    timer, cancel it with DELETE."""

    def __init__(self, spec: AgentSpec) -> None:
        if not spec.server_url:
            raise ValueError("agent.executor=http needs agent.server_url (the agent server's base URL)")
        super().__init__(spec)
        self._url = spec.server_url.rstrip("/")

    async def start(self, session_env: Mapping[str, str], io_dir: Path) -> None:
        """Send the session to the server; returns at once (the POST stays open until the agent is done)."""
        self._open(session_env, io_dir)
        payload = self._payload(session_env)
        self._note(f"POST {self._url}/sessions session_id={self._session_id}")
        self._launch(self._post(payload))

    def _payload(self, session_env: Mapping[str, str]) -> dict[str, Any]:
        """The POST body: session id, env, the input file's JSON, the budget and the sandbox limits."""
        env = {str(k): str(v) for k, v in self.spec.env.items()}
        env.update({k: str(session_env[k]) for k in SESSION_VARIABLES if k in session_env})
        return {"session_id": self._session_id, "env": env, "input": self._input(session_env),
                "timeout": self.spec.timeout, "sandbox": dict(self.spec.sandbox)}

    def _input(self, session_env: Mapping[str, str]) -> dict[str, Any]:
        """The session's input file as JSON; an unreadable one is an `AgentFailure`."""
        text = self._input_text(session_env)
        try:
            return json.loads(text)
        except ValueError as error:
            path = session_env.get("RELAX_INPUT_JSON")
            raise AgentFailure(f"could not read the input file {path} ({error})", None, "", self._log_path) from error

    async def _post(self, payload: dict[str, Any]) -> httpx.Response:
        timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            return await client.post(f"{self._url}/sessions", json=payload)

    def _answer(self, task: asyncio.Task[Any]) -> tuple[int | None, str, str, str | None]:
        """The server's answer; an unreachable server or a non-200 answer is an `AgentFailure`."""
        if isinstance(error := task.exception(), httpx.HTTPError):
            raise self._failure(f"could not reach the agent server at {self._url} ({type(error).__name__}: "
                                f"{error}); is it running? (agent.services starts it, agent.server_url names it)", None)
        response = task.result()
        if response.status_code != 200:
            self._note(response.text)
            raise self._failure(f"agent server answered HTTP {response.status_code} to POST /sessions", None)
        code, output, text = self._body(response)
        return code, output, text, None if code == 0 else f"exited with code {code} on the agent server"

    def _ended(self) -> str:
        return "the agent server was sent DELETE"

    def _body(self, response: httpx.Response) -> tuple[int, str, str]:
        """(exit_code, output, log) of a 200 answer; a malformed body is an `AgentFailure` naming the field."""
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("exit_code"), int):
            self._note(response.text)
            raise self._failure("agent server answered 200 without an integer exit_code (the body must be "
                                '{"exit_code": int, "output": str, "log": str})', None)
        output, text = body.get("output") or "", body.get("log") or ""
        if not isinstance(output, str) or not isinstance(text, str):
            raise self._failure("agent server answered output or log that is not a string", body["exit_code"])
        return body["exit_code"], output, text

    async def terminate(self) -> None:
        """Cancel a session still running: drop the POST and send DELETE; idempotent, no-op once it answered."""
        request = self._task
        if request is None or request.done():
            return
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await self._delete()

    async def _delete(self) -> None:
        """DELETE the session on the server; a failure is logged and noted, never raised."""
        url = f"{self._url}/sessions/{self._session_id}"
        try:
            async with httpx.AsyncClient(timeout=self.spec.grace_s, trust_env=False) as client:
                response = await client.delete(url)
            self._note(f"DELETE {url} -> HTTP {response.status_code} {response.text[:200]}")
        except httpx.HTTPError as error:
            self._note(f"DELETE {url} failed: {type(error).__name__}: {error}")
            log.warning("could not cancel session %s on the agent server: %s", self._session_id, error)

    def kill(self) -> None:
        """The run's last resort before it exits: one DELETE without waiting for more than a second."""
        if self._task is None or self._task.done():
            return
        try:
            httpx.delete(f"{self._url}/sessions/{self._session_id}", timeout=1.0, trust_env=False)
        except httpx.HTTPError:
            pass

