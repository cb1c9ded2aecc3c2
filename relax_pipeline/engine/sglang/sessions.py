"""SGLang sessions (`engine.sessions=true`): one server-side session per agent session, so its KV stays resident
between turns (a tool call included) and is released when the agent session ends, not by LRU eviction.

SGLang's non-streaming session (`/open_session`, `/close_session`, `session_params` on `/generate`) keeps a tree
of request nodes keyed by `rid`; a request that names a node continues that node's whole context (its input
and its output) with the new `input_ids`, or splices them at a token `offset` of it. `SessionTree` mirrors the
nodes this client made, each with its exact context (the prompt sent + the tokens generated), and turns a full
prompt into the shortest request: the node sharing the longest token prefix with the prompt is the parent; a
prompt that extends it whole sends only the new tokens (`{id, rid}`), one that leaves it part-way (a fork, or
the resume of an aborted generation) splices at the shared length (`{id, rid, offset}`), and one that shares
nothing starts a root (`{id}`). The delta never starts with BOS (SGLang drops a leading BOS of an appended
turn: the splice moves one token back instead) and is never empty. Aborted or failed requests are not
mirrored (their server-side output may differ from what the client saw), so no request ever continues from
a node whose tokens the client does not know exactly; `SglangEngine` checks `meta_info.prompt_tokens` against
the prompt's length as well.

`Sessions` opens a session lazily at the agent session's first turn (on the worker its affinity key picks;
behind smg on every worker, since the router picks the worker and does not forward `/open_session`),
closes it on `close`, and reports `engine/sessions_open`, `engine/sessions_closed`, `engine/session_close_s`
(mean seconds of a close), `engine/session_turns` and `engine/session_cached_tokens` (tokens per turn that the
session kept, from `meta_info.cached_tokens`). A session whose open failed is served without one (logged); a
turn the server refuses for its session (a node it no longer holds, a session its timeout closed) reopens the
session and is sent again as a root.

Not done here: the turn service calling `close` when an agent session ends (its hook), streaming sessions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
Call = Callable[..., Awaitable[Any]]
"""`SglangEngine._call(method, url, path, body, expect_json=...)`."""


@dataclass(frozen=True)
class SessionRequest:
    """What one session turn sends: the new ids, its `session_params`, the prompt tokens the session holds."""

    input_ids: list[int]
    params: dict[str, Any]
    kept: int


class SessionTree:
    """The request nodes of one session this client knows exactly (see the module)."""

    def __init__(self, session_id: str, bos_token_id: int | None) -> None:
        self.session_id = session_id
        self.bos = bos_token_id
        self.nodes: dict[str, tuple[int, ...]] = {}
        """Finished node rid → its whole context (assembled input + output)."""
        self._used: set[str] = set()

    def wire_rid(self, rid: str) -> str:
        """`rid`, or `rid~n` when the session already holds a node of that rid (a resumed generation)."""
        wire, n = rid, 0
        while wire in self._used:
            n += 1
            wire = f"{rid}~{n}"
        self._used.add(wire)
        return wire

    def request(self, prompt: Sequence[int]) -> SessionRequest:
        """The request that makes the server's context equal `prompt` (module docstring)."""
        parent, shared = self._best(prompt)
        if parent is None:
            return SessionRequest(list(prompt), {"id": self.session_id}, 0)
        whole = shared == len(self.nodes[parent])
        while shared > 0 and (shared == len(prompt) or prompt[shared] == self.bos):
            shared, whole = shared - 1, False
        if shared == 0:
            return SessionRequest(list(prompt), {"id": self.session_id}, 0)
        params = {"id": self.session_id, "rid": parent} if whole else \
            {"id": self.session_id, "rid": parent, "offset": shared}
        return SessionRequest(list(prompt[shared:]), params, shared)

    def finished(self, wire_rid: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Mirror a node that finished normally: its context is `prompt` + `output`."""
        self.nodes[wire_rid] = tuple(prompt) + tuple(output)

    def forget(self) -> None:
        """Drop every mirrored node (the server refused one: start again from a root)."""
        self.nodes.clear()

    def _best(self, prompt: Sequence[int]) -> tuple[str | None, int]:
        """The node sharing the longest prefix with `prompt` (one it extends whole first) and that length."""
        scored = [(_common(tokens, prompt), rid) for rid, tokens in self.nodes.items()]
        shared, best = max(scored, key=lambda s: (s[0], s[0] == len(self.nodes[s[1]])), default=(0, None))
        return (best, shared) if shared > 0 else (None, 0)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class OpenSession:
    """One agent session's SGLang session: where it is open, its tree, the worker its turns go to."""

    tree: SessionTree
    urls: list[str]
    worker: Any
    """The `WorkerLoad` of its turns (the router's shared one behind smg)."""
    key: str
    """The routing key of its turns (sticky behind smg)."""
    opened: float = field(default_factory=time.monotonic)


class Sessions:
    """The open SGLang sessions of one engine, by agent session id (see the module)."""

    def __init__(self, call: Call, capacity: int, timeout_s: float | None, bos_token_id: int | None) -> None:
        self.call = call
        self.capacity, self.timeout_s, self.bos = capacity, timeout_s, bos_token_id
        self.open: dict[str, OpenSession] = {}
        self._failed: set[str] = set()
        self._opening: dict[str, asyncio.Future[None]] = {}
        """Sessions whose `/open_session` is on its way (a concurrent first turn waits for it)."""
        self._metrics = {"closed": 0, "close_s": 0.0, "turns": 0, "cached": 0}

    async def get(self, session_id: str, urls: list[str], worker: Any, key: str) -> OpenSession | None:
        """The open session `session_id`, opened on `urls` at its first turn (concurrent first turns wait for one
        open); None when it could not be."""
        while session_id in self._opening:
            await asyncio.shield(self._opening[session_id])
        session = self.open.get(session_id)
        if session is not None or session_id in self._failed:
            return session
        self._opening[session_id] = asyncio.get_running_loop().create_future()
        try:
            return await self._open(session_id, urls, worker, key)
        finally:
            self._opening.pop(session_id).set_result(None)

    async def _open(self, session_id: str, urls: list[str], worker: Any, key: str) -> OpenSession | None:
        body = {"capacity_of_str_len": self.capacity, "session_id": session_id, "timeout": self.timeout_s}
        opened: list[str] = []
        try:
            for url in urls:
                await self.call("POST", url, "/open_session", body)
                opened.append(url)
        except RuntimeError as error:  # SglangError: serve this agent session without one
            log.warning("sglang: /open_session %s failed, its turns go without a session: %s", session_id, error)
            self._failed.add(session_id)
            await self._close_on(session_id, opened)
            return None
        session = OpenSession(SessionTree(session_id, self.bos), opened, worker, key)
        self.open[session_id] = session
        return session

    async def reopen(self, session: OpenSession) -> None:
        """Open `session` again where the server dropped it (its timeout) and forget its nodes: its next turn is a
        root. An open that fails because the session is still open is fine."""
        session.tree.forget()
        body = {"capacity_of_str_len": self.capacity, "session_id": session.tree.session_id, "timeout": self.timeout_s}
        for url in session.urls:
            try:
                await self.call("POST", url, "/open_session", body)
            except RuntimeError as error:
                log.info("sglang: reopening session %s on %s: %s", session.tree.session_id, url, error)

    def turn(self, cached_tokens: int) -> None:
        """Count one session turn and the prompt tokens the session kept for it."""
        self._metrics["turns"] += 1
        self._metrics["cached"] += cached_tokens

    async def close(self, session_id: str) -> None:
        """Close `session_id` where it is open (unknown or closed already: nothing); errors are logged."""
        self._failed.discard(session_id)
        session = self.open.pop(session_id, None)
        if session is None:
            return
        started = time.monotonic()
        await self._close_on(session_id, session.urls)
        self._metrics["closed"] += 1
        self._metrics["close_s"] += time.monotonic() - started

    async def close_all(self) -> None:
        for session_id in list(self.open):
            await self.close(session_id)

    def take_metrics(self) -> dict[str, float]:
        """The `engine/session*` metrics since the last call; resets the counts."""
        m = self._metrics
        metrics = {"engine/sessions_open": float(len(self.open)), "engine/sessions_closed": float(m["closed"]),
                   "engine/session_close_s": m["close_s"] / m["closed"] if m["closed"] else 0.0,
                   "engine/session_turns": float(m["turns"]),
                   "engine/session_cached_tokens": m["cached"] / m["turns"] if m["turns"] else 0.0}
        self._metrics = {"closed": 0, "close_s": 0.0, "turns": 0, "cached": 0}
        return metrics

    async def _close_on(self, session_id: str, urls: list[str]) -> None:
        for url in urls:
            try:
                await self.call("POST", url, "/close_session", {"session_id": session_id}, expect_json=False)
            except RuntimeError as error:
                log.warning("sglang: /close_session %s on %s failed: %s", session_id, url, error)
