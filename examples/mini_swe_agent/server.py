"""An agent server for `agent.executor=http`: runs the real mini-swe-agent on a generated repository, with
every command it issues executed in a sandbox, and scores the session by the repository's tests.

    python server.py --port 8700 [--host 127.0.0.1] [--step-limit 6]

The wire contract is `relax_pipeline/agent/http_executor.py`'s: `POST /sessions` runs one session and answers
`{"exit_code", "output", "log"}` when it is done; `DELETE /sessions/{id}` cancels it; `GET /health`. Per
session (each in its own worker thread, so sessions run concurrently):

1. a temporary directory gets the repository from the input's `metadata.repo` (file name → text);
2. a `Sandbox` (`relax_pipeline.agent.sandbox`) over that directory applies the request's `sandbox` limits:
   no network, no writes outside the directory, CPU/memory/file-size/process limits, a wall timeout per
   command. A platform that cannot isolate the network (and `sandbox.allow_network=false`) fails the
   session with the sandbox's message (exit code 2);
3. mini-swe-agent's `DefaultAgent` with its built-in `mini.yaml` runs on the task (the input's first user
   message) with `LitellmModel` (`hosted_vllm/<RELAX_MODEL>`, `api_base` = `RELAX_BASE_URL` + `v1`, key
   `RELAX_API_KEY`) and `SandboxEnvironment`, which runs each bash command through `Sandbox.run`; at most
   `--step-limit` model calls;
4. the repository's `metadata.test_command` runs in the sandbox: output `{"reward": 1.0 if it exits 0 else
   0.0, "metadata": {"exit_status", "tests_passed", "model_calls"}}`, exported implicitly (the pipeline
   recorded every model call). The agent not submitting is not a failure: its reward says how it did.

`DELETE` sets the session's cancel flag and closes its sandbox (its running command's process tree is
killed); the agent stops at its next step and the session answers exit code 130. Any other exception
answers exit code 1 with its traceback in the log. Not done here: authentication, and persistence (a
restarted server forgets its sessions; the pipeline records them as failed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _key, _value in {"MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
                     "MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                     "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"}.items():
    os.environ.setdefault(_key, _value)  # offline, no first-run setup, no price, the pipeline owns retries

import litellm  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_from_spec  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

from relax_pipeline.agent.sandbox import Sandbox, SandboxLimits, SandboxUnavailable  # noqa: E402

litellm.suppress_debug_info = True  # no 'Provider List' banner per cost lookup of our unpriced model

LOG_LIMIT = 8000
"""Characters of a session's log sent back (its end)."""


class Cancelled(Exception):
    """The session was cancelled by DELETE."""


class SessionLog:
    """A session's log lines, kept in memory and answered with the session."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text if text.endswith("\n") else text + "\n")

    def tail(self) -> str:
        return "".join(self.lines)[-LOG_LIMIT:]


@dataclass
class Live:
    """A running session: its cancel flag and, once made, its sandbox."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    sandbox: Sandbox | None = None


class SandboxEnvironment(LocalEnvironment):
    """mini-swe-agent's environment interface with every command run by `Sandbox.run` in the session folder."""

    def __init__(self, sandbox: Sandbox, live: Live, log: SessionLog, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sandbox, self.live, self.log = sandbox, live, log

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        if self.live.cancelled.is_set():
            raise Cancelled("cancelled by DELETE")
        command = action.get("command", "")
        result = self.sandbox.run(command, cwd=Path(cwd) if cwd else None, env=dict(self.config.env),
                                  timeout=timeout)
        info = "timed out after the sandbox's wall timeout; its processes were killed" if result.timed_out else ""
        output = {"output": result.output, "returncode": result.returncode, "exception_info": info}
        self.log.write(f"$ {command}\n[exit {result.returncode}{' timed out' if result.timed_out else ''}] "
                       f"{result.output[-500:]}")
        self._check_finished(output)
        return output


class CancellableAgent(DefaultAgent):
    """`DefaultAgent` that stops at its next step once the session is cancelled."""

    def __init__(self, *args: Any, live: Live, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live = live

    def step(self) -> list[dict]:
        if self.live.cancelled.is_set():
            raise Cancelled("cancelled by DELETE")
        return super().step()


class Sessions:
    """The server's running sessions, by id."""

    def __init__(self, step_limit: int) -> None:
        self.step_limit = step_limit
        self.config = get_config_from_spec("mini.yaml")
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()

    def run(self, body: dict[str, Any]) -> dict[str, Any]:
        """One session, start to answer."""
        live, log, session_id = Live(), SessionLog(), str(body["session_id"])
        with self._lock:
            self._live[session_id] = live
        workdir = Path(tempfile.mkdtemp(prefix="mswea-"))
        try:
            return self._run(body, live, log, workdir)
        except Cancelled as error:
            return _answer(130, log, str(error))
        except SandboxUnavailable as error:
            return _answer(2, log, f"sandbox unavailable: {error}")
        except Exception:  # noqa: BLE001 - any failure is this session's, answered with its traceback
            if live.cancelled.is_set():  # a command was refused by the sandbox DELETE had just closed
                return _answer(130, log, "cancelled by DELETE")
            return _answer(1, log, traceback.format_exc())
        finally:
            with self._lock:
                self._live.pop(session_id, None)
            if live.sandbox is not None:
                live.sandbox.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _run(self, body: dict[str, Any], live: Live, log: SessionLog, workdir: Path) -> dict[str, Any]:
        metadata = body["input"].get("metadata") or {}
        write_repo(workdir, metadata.get("repo") or {})
        live.sandbox = Sandbox(workdir, SandboxLimits.from_mapping(body.get("sandbox") or {}))
        if live.cancelled.is_set():
            raise Cancelled("cancelled by DELETE")
        agent = self._agent(body["env"], live, log, workdir)
        result = agent.run(task=task_text(body["input"]))
        log.write(f"mini-swe-agent ended: {result.get('exit_status')} after {agent.n_calls} model calls")
        test = live.sandbox.run(metadata.get("test_command") or "true", env=self._env())
        log.write(f"$ {metadata.get('test_command')}\n[exit {test.returncode}] {test.output[-1000:]}")
        passed = test.returncode == 0 and not test.timed_out
        output = {"reward": 1.0 if passed else 0.0, "metadata": {
            "exit_status": str(result.get("exit_status")), "tests_passed": passed, "model_calls": agent.n_calls}}
        return {"exit_code": 0, "output": json.dumps(output), "log": log.tail()}

    def _agent(self, env: dict[str, str], live: Live, log: SessionLog, workdir: Path) -> CancellableAgent:
        config = self.config
        endpoint = {"api_base": env["RELAX_BASE_URL"].rstrip("/") + "/v1", "api_key": env["RELAX_API_KEY"]}
        model = LitellmModel(model_name=f"hosted_vllm/{env['RELAX_MODEL']}", **{
            **config["model"], "model_kwargs": {**config["model"].get("model_kwargs", {}), **endpoint}})
        environment = SandboxEnvironment(live.sandbox, live, log, **{**config["environment"],
                                                                      "env": self._env(), "cwd": str(workdir)})
        agent_config = {**config["agent"], "step_limit": self.step_limit}
        agent_config.pop("mode", None)  # interactive-agent key, unknown to DefaultAgent
        return CancellableAgent(model, environment, live=live, **agent_config)

    def _env(self) -> dict[str, str]:
        """Commands' environment: mini.yaml's (PAGER=cat, ...) and a PATH whose `python` is this server's."""
        path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
        return {**self.config["environment"].get("env", {}), "PATH": path}

    def cancel(self, session_id: str) -> bool:
        """Set the session's cancel flag and close its sandbox (killing its running command)."""
        with self._lock:
            live = self._live.get(session_id)
        if live is None:
            return False
        live.cancelled.set()
        if live.sandbox is not None:
            live.sandbox.close()
        return True


def write_repo(workdir: Path, files: dict[str, str]) -> None:
    """Write the repository's files under `workdir`; a path leaving it is refused."""
    for name, text in files.items():
        target = (workdir / name).resolve()
        if workdir.resolve() not in target.parents:
            raise ValueError(f"metadata.repo file {name!r} is outside the repository; use relative paths")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def task_text(payload: dict[str, Any]) -> str:
    """The first user message's text."""
    for message in payload.get("messages") or []:
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
    raise ValueError("the session input has no user message; the dataset row's input is the task text")


def _answer(code: int, log: SessionLog, text: str) -> dict[str, Any]:
    log.write(text)
    return {"exit_code": code, "output": "", "log": log.tail()}


def create_app(step_limit: int) -> FastAPI:
    app, sessions = FastAPI(), Sessions(step_limit)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/sessions")
    def post(body: dict[str, Any]) -> dict[str, Any]:  # a sync route: one worker thread per session
        return sessions.run(body)

    @app.delete("/sessions/{session_id}")
    def delete(session_id: str) -> dict[str, bool]:
        return {"cancelled": sessions.cancel(session_id)}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step-limit", type=int, default=6, help="model calls per session")
    args = parser.parse_args()
    uvicorn.run(create_app(args.step_limit), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
