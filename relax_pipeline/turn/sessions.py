"""The sessions of a run: `Session`, its state machine (`Status`), and `ForestStore`, the registry every stage and
the gateway share.

Sessions. A session is one agent process working on one copy of a prompt. Its life is a small state machine
designed for every runtime mode, of which `sync` uses the first and the terminal states:

    created ─► waiting ─► running ─► exited ─► completed | truncated
       │          │   ▲       │  │                 (samples exported)
       │          │   └parked◄┘  └──────────────► failed | dropped | filtered | aborted
       └──────────┴─────────────────────────────► dropped

`waiting`: the process runs but its group holds no runtime lease yet (prelaunch holds first requests
here); `parked`: between steps under partial/fully-async modes. The gateway serves requests only in
`waiting`/`running`/`parked` states and answers 404 in terminal ones. Every session ends in exactly one
terminal state with a reason, so nothing is lost silently. `ForestStore` is the typed registry every stage
and the gateway share; sessions change only through it, and it does no I/O.

Credentials (docs/design.md §4, invariant 7): a session id (`sess-`, not secret) and a separate key (`rk-`,
never logged); `authenticate` finds a session by its key, and by its id only with `session_ids=True` (a
loopback gateway). `release` forgets an ended session once its group's rows are written (the pipeline does it at the
end of each step), keeping only its key, id and final status, so a run of days holds the sessions of its
live groups, not every forest it ever recorded.

Not done here: model turns (`service.py`), reading credentials off a request (the gateway).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from relax_pipeline.canonical.form import Message
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.engine.base import derive_seed
from relax_pipeline.forest.store import SessionForest
from relax_pipeline.turn.records import Lease

__all__ = ["ForestStore", "Session", "Status"]

T = TypeVar("T")


class Status(StrEnum):
    CREATED = "created"
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    EXITED = "exited"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"
    DROPPED = "dropped"
    FILTERED = "filtered"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def serving(self) -> bool:
        return self in (Status.WAITING, Status.RUNNING, Status.PARKED)


_TERMINAL = frozenset(
    {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED, Status.DROPPED, Status.FILTERED}
)


@dataclass
class Session:
    """One agent run on one prompt copy; owned by the ForestStore, mutated only through it."""

    id: str
    group_id: str
    index: int
    rollout_id: int
    mode: str
    prompt: dict[str, Any]
    status: Status = Status.CREATED
    error: str | None = None
    forest: SessionForest = field(default_factory=SessionForest)
    memo: RequestMemo = field(default_factory=RequestMemo)
    timing: dict[str, float] = field(default_factory=dict)
    abort_count: int = 0
    in_flight: int = 0
    seed: int = 0
    """Base of the sampling seeds of this session's turns (requests without their own seed)."""
    lease: Lease | None = None
    """The group's lease (barrier, hold, preemption); None serves requests at once (tests, eval)."""
    responses: dict[str, int] = field(default_factory=dict)
    """Response id → the response node it committed (so a request may continue from it by id)."""
    key: str = field(default_factory=lambda: "rk-" + secrets.token_urlsafe(24), repr=False)
    """The session's secret credential (`RELAX_API_KEY`); random, independent of `id`, never logged."""

    def mark(self, event: str) -> None:
        self.timing[event] = time.time()

    def turn_seed(self) -> int:
        """The sampling seed of this session's next turn: reproducible from the run seed and the turn."""
        return derive_seed(self.seed, self.forest.turn_count)


class ForestStore:
    """All sessions of a run by id; the gateway authenticates against it."""

    def __init__(self, on_end: Callable[[Session], None] | None = None) -> None:
        self.on_end = on_end
        """Called once when a session reaches a terminal status (the turn service releases the engine's KV)."""
        self._sessions: dict[str, Session] = {}
        self._keys: dict[str, Session] = {}
        self._released: dict[str, tuple[str, Status]] = {}
        """Key → (id, final status) of released sessions: enough to answer their late requests with a 404."""
        self._released_ids: dict[str, tuple[str, Status]] = {}
        """The same by session id, for a loopback gateway where the id is a credential too."""

    def open(self, group_id: str, index: int, rollout_id: int, mode: str, prompt: dict[str, Any],
             seed: int = 0) -> Session:
        """A new session with a random id (its key); `seed` is the base of its turns' sampling seeds."""
        session = Session("sess-" + secrets.token_hex(12), group_id, index, rollout_id, mode, prompt, seed=seed)
        session.mark("created")
        self._sessions[session.id] = session
        self._keys[session.key] = session
        return session

    def get(self, session_id: str) -> Session | None:
        """The session named `session_id` (not a credential: see `authenticate`)."""
        return self._sessions.get(session_id)

    def authenticate(self, credential: str, session_ids: bool = False) -> Session | None:
        """The session whose secret key is `credential`; with `session_ids` (a loopback gateway) also the
        session whose id it is. None for anything else (a session id too, unless `session_ids`)."""
        session = self._keys.get(credential)
        if session is None and session_ids:
            session = self._sessions.get(credential)
        return session

    def released(self, credential: str, session_ids: bool = False) -> tuple[str, Status] | None:
        """(id, final status) of the released session whose key is `credential` (or, with `session_ids`, whose
        id it is); None for anything else."""
        found = self._released.get(credential)
        if found is None and session_ids:
            found = self._released_ids.get(credential)
        return found

    def release(self, session: Session) -> bool:
        """Forget an ended session whose rows are written (its forest, memo and prompt go with it); its key
        keeps answering 404. A session still live is kept; returns whether `session` was released."""
        if not session.status.terminal:
            return False
        self._sessions.pop(session.id, None)
        self._keys.pop(session.key, None)
        self._released[session.key] = self._released_ids[session.id] = (session.id, session.status)
        return True

    def set_status(self, session: Session, status: Status, error: str | None = None) -> None:
        """Move a session to `status`; a terminal state is final and keeps its first reason."""
        if session.status.terminal:
            return
        session.status = status
        if error is not None:
            session.error = error
        session.mark(status.value)
        if status.terminal and self.on_end is not None:
            self.on_end(session)

    def attach_lease(self, session: Session, lease: Lease) -> None:
        """From now on `session`'s requests wait on its group's `lease`."""
        session.lease = lease

    def count_abort(self, session: Session) -> None:
        session.abort_count += 1

    def remember_response(self, session: Session, response_id: str, node_id: int) -> None:
        """`response_id` (as the client saw it) names the response node `node_id` of `session`."""
        session.responses[response_id] = node_id

    def response_history(self, session: Session, response_id: str) -> tuple[Message, ...] | None:
        """The conversation up to and including the response `response_id` of `session`; None if unknown."""
        node_id = session.responses.get(response_id)
        if node_id is None:
            return None
        return session.forest.history(node_id)

    async def serving(self, session: Session, work: Awaitable[T]) -> T:
        """Await `work` with a request of `session` counted in flight (a plain try: no generator per request)."""
        session.in_flight += 1
        try:
            return await work
        finally:
            session.in_flight -= 1

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
