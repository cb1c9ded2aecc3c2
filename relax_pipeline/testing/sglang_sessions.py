"""The sessions of the SGLang-wire fake (`testing/sglang_server.py`), as SGLang's non-streaming sessions
(`sglang/srt/session/session_controller.py` of the pinned release).

`/open_session {capacity_of_str_len, session_id, timeout}` answers the id (400 when it is open already), `/close_session
{session_id}` drops the session (an unknown id is ignored), a session idle longer than its `timeout` is
closed. A `/generate` with `session_params {id, rid, offset, replace}` is a node of the session's tree,
keyed by its own `rid`: with `rid` it continues the node's context (its input and output) with the new
`input_ids` (a leading BOS dropped), or splices them at token `offset`; `replace` first aborts the node and
drops its children (without `rid`: every node); without `rid` it is a new root. A `rid` the session does not
hold, or one still generating, is refused (400, SGLang's message). `meta_info.cached_tokens` is the context
the session kept; `prompt_tokens` is the whole assembled input.

Not modelled: streaming sessions, `drop_previous_output`, images carried over by a session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class Refused(Exception):
    """A request SGLang would refuse: answered 400 with SGLang's error shape."""


@dataclass
class FakeNode:
    """One request of a session: its whole context once finished (assembled input + output)."""

    tokens: list[int]
    parent: str | None
    finished: bool = False
    children: list[str] = field(default_factory=list)


@dataclass
class FakeSession:
    """One open session (SGLang's `Session`, non-streaming)."""

    capacity_of_str_len: int
    timeout: float | None
    last_active: float = field(default_factory=time.monotonic)
    nodes: dict[str, FakeNode] = field(default_factory=dict)

    def timed_out(self, now: float) -> bool:
        return self.timeout is not None and now - self.last_active > self.timeout


class FakeSessions:
    """The open sessions of one fake server and their request trees (see the module)."""

    def __init__(self) -> None:
        self.open: dict[str, FakeSession] = {}
        self.closed = 0
        """Sessions closed so far (by `/close_session` or by their timeout)."""

    def start(self, body: dict[str, Any]) -> str:
        self.reap()
        sid = body.get("session_id")
        if not isinstance(sid, str) or sid in self.open:
            raise Refused("Failed to open the session. Check if a session with the same id is still open.")
        timeout = body.get("timeout")
        self.open[sid] = FakeSession(int(body["capacity_of_str_len"]), None if timeout is None else float(timeout))
        return sid

    def close(self, sid: str) -> list[str]:
        """Close `sid` (unknown: nothing); the rids of its nodes still generating (to abort)."""
        session = self.open.pop(sid, None)
        if session is None:
            return []
        self.closed += 1
        return [rid for rid, node in session.nodes.items() if not node.finished]

    def reap(self) -> list[str]:
        """Close the sessions idle past their timeout; the rids still generating in them."""
        now = time.monotonic()
        return [rid for sid in [s for s, session in self.open.items() if session.timed_out(now)]
                for rid in self.close(sid)]

    def assemble(self, params: dict[str, Any], ids: list[int], rid: str, bos: int | None) -> tuple[list[int], int,
                                                                                                     list[str]]:
        """The whole input of a session request, the tokens the session kept, and rids to abort (`replace`)."""
        session = self.open.get(str(params.get("id")))
        if session is None:
            raise Refused(f"Invalid request: session id {params.get('id')} does not exist")
        session.last_active = time.monotonic()
        parent, aborted = self._parent(session, params)
        if parent is None:
            context, kept = list(ids), 0
        else:
            new = ids[1:] if ids and bos is not None and ids[0] == bos else ids
            offset = params.get("offset")
            kept = offset if offset else len(session.nodes[parent].tokens)
            context = session.nodes[parent].tokens[:kept] + new
        if not context:
            raise Refused("A session request must contain input tokens after restoring history.")
        session.nodes[rid] = FakeNode(context, parent)
        if parent is not None:
            session.nodes[parent].children.append(rid)
        return context, kept, aborted

    def finish(self, sid: str, rid: str, output: list[int]) -> None:
        """The node `rid` finished (or was aborted) with `output`: its context grows by it."""
        session = self.open.get(sid)
        node = session.nodes.get(rid) if session is not None else None
        if node is not None and not node.finished:
            node.tokens = node.tokens + output
            node.finished = True

    def _parent(self, session: FakeSession, params: dict[str, Any]) -> tuple[str | None, list[str]]:
        rid = params.get("rid")
        if params.get("replace"):
            if rid is None:
                return None, [r for root in list(session.nodes) for r in self._clear(session, root)]
            if rid not in session.nodes:
                raise Refused("Invalid request session id")
            node = session.nodes[rid]
            aborted = [] if node.finished else [rid]
            node.finished = True
            aborted += [r for child in list(node.children) for r in self._clear(session, child)]
            node.children = []
            return rid, aborted
        if rid is None:
            return None, []
        if rid not in session.nodes:
            raise Refused("Invalid request session id")
        if not session.nodes[rid].finished:
            raise Refused("Session request is appending to a request that hasn't finished.")
        return rid, []

    def _clear(self, session: FakeSession, rid: str) -> list[str]:
        """Drop node `rid` and its subtree; the rids among them still generating."""
        node = session.nodes.pop(rid, None)
        if node is None:
            return []
        return ([] if node.finished else [rid]) + [r for child in node.children for r in self._clear(session, child)]
