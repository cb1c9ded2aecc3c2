"""Prepare stage: open a group's sessions, write their input files and start their agents.

One session per copy of the prompt (`rollout.n_samples_per_prompt`), each with its own io folder,
input file and `RELAX_*` environment (docs/design.md §3.2). A session whose group lease is not granted yet
(prelaunch) starts `waiting`, with its agent's active-time clock paused. This stage does not wait for
agents.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_pipeline.agent.executors import new_agent
from relax_pipeline.agent.launcher import AgentFailure, AgentSpec
from relax_pipeline.agent.session_io import build_input, write_input
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.engine.base import derive_seed
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.settings import RolloutSettings
from relax_pipeline.turn.sessions import ForestStore, Session, Status


@dataclass(frozen=True)
class AgentPools:
    """The agents sessions run on: the train pool (`agent.*`) and, when `eval.agent` sets one, eval's own."""

    train: AgentSpec
    eval: AgentSpec | None = None

    def for_mode(self, mode: str) -> AgentSpec:
        return self.eval if mode == "eval" and self.eval is not None else self.train


class Prepare:
    """Creates sessions and launches one agent per session (`agent.executor`: a local process or an agent server)."""

    def __init__(self, store: ForestStore, agents: AgentPools, io_root: Path, base_url: str,
                 rollout: RolloutSettings, seed: int = 0, model_name: str = "relax") -> None:
        self.store = store
        self.agents = agents
        self.io_root = io_root
        self.base_url = base_url
        self.n_samples = rollout.n_samples_per_prompt
        """`rollout.n_samples_per_prompt`: sessions per train group."""
        self.chat_template_kwargs = dict(rollout.chat_template_kwargs)
        """`rollout.chat_template_kwargs`: written into each session's input."""
        self.seed = seed
        self.model_name = model_name
        """The served model name (`RELAX_MODEL`); requests may name any model, it is echoed."""

    def open_group(self, prompt: Prompt, rollout_id: int, mode: str = "train", n_samples: int | None = None) -> Group:
        """A group of `n_samples` sessions (default `rollout.n_samples_per_prompt`; eval datasets set their own)."""
        group = Group(f"g{rollout_id}-{prompt.index}-{secrets.token_hex(3)}", prompt, rollout_id, mode, self.io_root)
        payload = build_input(prompt.input, prompt.metadata or None, prompt.images)
        for index in range(n_samples or self.n_samples):
            seed = derive_seed(self.seed, rollout_id, prompt.index, index)
            session = self.store.open(group.id, index, rollout_id, mode, payload, seed)
            group.sessions.append(session)
        return group

    async def start(self, group: Group) -> None:
        """Write inputs and start every session's agent; a start failure fails that session."""
        for session in group.sessions:
            folder = group.session_dir(session)
            folder.mkdir(parents=True, exist_ok=True)
            write_input(folder / "input.json", self._input(session))
            process = new_agent(self.agents.for_mode(group.mode))
            group.processes[session.id] = process
            self.store.set_status(session, Status.WAITING if _held(session) else Status.RUNNING)
            try:
                await process.start(self._env(group, session, folder), folder)
            except AgentFailure as failure:
                self.store.set_status(session, Status.FAILED, str(failure))
                continue
            if _held(session):  # looked at again: the lease may have changed while the process started
                process.timer.pause()  # a prelaunched agent's active time starts with its group's lease

    def _input(self, session: Session) -> dict[str, Any]:
        payload = dict(session.prompt)
        if self.chat_template_kwargs:
            payload.setdefault("chat_template_kwargs", dict(self.chat_template_kwargs))
        return payload

    def _env(self, group: Group, session: Session, folder: Path) -> dict[str, str]:
        return {
            "RELAX_INPUT_JSON": str(folder / "input.json"),
            "RELAX_OUTPUT_JSON": str(folder / "output.json"),
            "RELAX_SESSION_IO_DIR": str(folder),
            "RELAX_BASE_URL": self.base_url,
            "RELAX_SESSION_ID": session.id,
            "RELAX_API_KEY": session.key,
            "RELAX_MODEL": self.model_name,
            "RELAX_ROLLOUT_MODE": group.mode,
            "RELAX_GROUP_ID": group.id,
        }


def _held(session: Session) -> bool:
    """The session's group lease exists and is not granted (prelaunched or parked)."""
    return session.lease is not None and not session.lease.granted
