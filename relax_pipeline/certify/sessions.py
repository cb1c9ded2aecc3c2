"""Real sessions for `job=check`: the run's own pipeline, with every request an agent sent kept beside its turn.

`run_sessions` starts `n` groups of one session each (the data source's next prompts, so a failing agent fails
only its own group), through the run's `Pipeline` (Prepare → Runtime → Reward → Transfer) and its gateway and
engine, and returns each session with its dump rows. Each session's forest is a `RecordingForest`, set before
its agent starts: it is the `SessionForest` the turn service matches against, and it also keeps, for every
committed turn, the messages and context the agent sent (`SentTurn`), which the forest itself does not keep
(a request that re-sends a turn without its reasoning is stored with the committed message), and the requests
that attached but never committed (`unanswered`: a template that cannot render them, an engine that failed).

A failure of an agent or of the engine is recorded on its session and group, never raised. This module does not
judge what it recorded (`certify/examine.py` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.forest.store import Attachment, ForkEvent, Node, Observation, SessionForest, TurnTiming
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.turn.sessions import Session

CHECK_ROLLOUT = 0
"""The rollout id of the check's groups."""


@dataclass(frozen=True)
class SentTurn:
    """One committed turn and the request that made it; connects the recording forest to `examine`."""

    node_id: int
    """The response node the turn committed."""
    context: Context
    messages: tuple[Message, ...]
    """The canonical messages as the agent sent them (before any committed turn replaced one)."""
    fork: ForkEvent | None
    """The fork the request made, if it left the committed history."""


class RecordingForest(SessionForest):
    """A `SessionForest` that also keeps each committed turn's request (`turns`) and the requests that attached
    but never committed (`unanswered`)."""

    def __init__(self) -> None:
        super().__init__()
        self.turns: list[SentTurn] = []
        self._pending: dict[int, tuple[Attachment, Context, tuple[Message, ...]]] = {}

    def attach(self, context: Context, messages: Sequence[Message], hashes: Sequence[bytes] = (),
               reuse_visible: bool = False, media: bool = False) -> Attachment:
        attachment = super().attach(context, messages, hashes, reuse_visible, media)
        self._pending[id(attachment)] = (attachment, context, tuple(messages))
        return attachment

    def commit(self, attachment: Attachment, observation: Observation, message: Message, result: GenerateResult,
               sampling: SamplingParams, ends_turn: bool, timing: TurnTiming | None = None) -> Node:
        node = super().commit(attachment, observation, message, result, sampling, ends_turn, timing)
        _, context, messages = self._pending.pop(id(attachment), (None, attachment.match.context, ()))
        self.turns.append(SentTurn(node.id, context, messages, attachment.match.fork))
        return node

    @property
    def unanswered(self) -> list[tuple[Context, tuple[Message, ...]]]:
        """Requests that attached and never committed (the turn failed after matching)."""
        return [(context, messages) for _, context, messages in self._pending.values()]


@dataclass
class SessionRun:
    """One checked session: the session (its forest a `RecordingForest`), its group and its dump rows."""

    session: Session
    group: Group
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def forest(self) -> RecordingForest:
        assert isinstance(self.session.forest, RecordingForest)
        return self.session.forest


async def run_sessions(pipeline: Pipeline, n: int) -> list[SessionRun]:
    """`n` one-session groups through the pipeline, at once; each session with its rows (see the module)."""
    groups = await asyncio.gather(*(pipeline.start_group(CHECK_ROLLOUT, n_samples=1, on_open=_record)
                                    for _ in range(n)))
    rows = await asyncio.gather(*(_finish(pipeline, g) for g in groups))
    return [SessionRun(s, g, [r for r in group_rows if r["session_id"] == s.id])
            for g, group_rows in zip(groups, rows, strict=True) for s in g.sessions]


def _record(group: Group) -> None:
    for session in group.sessions:
        session.forest = RecordingForest()


async def _finish(pipeline: Pipeline, group: Group) -> list[dict[str, Any]]:
    exports = await pipeline.await_group(group)
    return await pipeline.score_group(group, exports)
