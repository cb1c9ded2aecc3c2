"""A step's sessions as trace trees: the times the turn service and the stages stamped, laid out as `SpanRecord`s.

`step_traces` turns every session of a step's groups into one `tracking.traces.SpanRecord` tree (the span names,
attributes and the choice of child spans for the training step are in `tracking/traces.py`'s docstring), from:

- the session's marks (`Session.timing`, epoch seconds): `created`, `exited`, `exported` (Runtime), `scoring`,
  `scored`, `credited` (Reward), its terminal status;
- each response node's `TurnTiming` (the turn service's clock: start, total, and one `GenerationPiece` per engine
  call with its first token when the engine says): a turn's `queue` runs from its start to its first engine call,
  each piece is `prefill` (to its first token) then `decode`, a piece after a preemption is a `resume` (its prefill
  and decode below it) after an `abort` span covering the time it was parked;
- the step's `TrainTiming` (the loop's clock around `trainer.train` and the trainer's micro-batches).

The agent's own time is every part of [created, exited] that no turn covers (`agent_gap`), so a session's turns
and gaps add up to its recorded time (exited - created) when its turns do not overlap. Nothing here runs on the
hot path: it is called once per step, after training, on plain numbers already recorded.

What it does not do: make OpenTelemetry spans or write files (`tracking.traces.TraceWriter` does), or trace eval
sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_pipeline.forest.store import GenerationPiece, Node, SessionForest
from relax_pipeline.stages.group import Group
from relax_pipeline.tracking.traces import AttributeValue, SpanRecord
from relax_pipeline.turn.sessions import Session

NS = 1_000_000_000


@dataclass(frozen=True)
class MicroBatchTiming:
    """When one micro-batch of the step ran and which samples it held; connects the trainer's timeline to the
    `micro_batch` spans."""

    optimizer_step: int
    index: int
    start_ns: int
    end_ns: int
    samples: frozenset[int]
    """`id()` of each `Sample` object it trained (the step's samples are alive while the traces are built)."""


@dataclass(frozen=True)
class TrainTiming:
    """The step's `trainer.train` call; connects the step loop's clock to the `train_step` spans."""

    start_ns: int
    end_ns: int
    version: int
    """The weight version the step trained (the one its lag-0 tokens were sampled by)."""
    micro_batches: tuple[MicroBatchTiming, ...] = ()


def step_traces(groups: Sequence[Group], step: int, train: TrainTiming | None = None) -> list[SpanRecord]:
    """One trace tree per session of `groups`, in group order."""
    return [session_trace(group, session, step, train) for group in groups for session in group.sessions]


def session_trace(group: Group, session: Session, step: int, train: TrainTiming | None = None) -> SpanRecord:
    """`session`'s tree: its turns and agent gaps, export, reward, credit and the training step that used it."""
    base: dict[str, AttributeValue] = {"relax.session_id": session.id, "relax.step": step}
    marks = session.timing
    created = _ns(marks.get("created", min(marks.values(), default=0.0)))
    turns = [_turn(node, i, session.forest, base) for i, node in enumerate(_responses(session.forest))]
    exited = _ns(marks["exited"]) if "exited" in marks else max([created, *(t.end_ns for t in turns)])
    children = [*_gaps(created, exited, turns, base), *turns, *_stages(marks, exited, base)]
    if train is not None and (spans := _train(group, session, train, base)) is not None:
        children.append(spans)
    children.sort(key=lambda s: s.start_ns)
    end = max([exited, *(c.end_ns for c in children)])
    attributes = {**base, "relax.group_id": group.id, "relax.mode": session.mode, "relax.status": session.status.value,
                  "relax.turns": len(turns), "relax.aborts": session.abort_count}
    return SpanRecord("session", created, end, attributes, tuple(children))


def _responses(forest: SessionForest) -> list[Node]:
    return [node for node in forest.nodes if node.kind == "response" and node.timing is not None]


def _turn(node: Node, index: int, forest: SessionForest, base: dict[str, AttributeValue]) -> SpanRecord:
    timing = node.timing
    assert timing is not None
    start = _ns(timing.started_at)
    versions = list(node.weight_versions)
    prompt = sum(len(n.token_ids) for n in forest.lineage(node)[:-1])
    attributes = {**base, "relax.turn": index, "relax.weight_version": versions[-1] if versions else -1,
                  "relax.prompt_tokens": prompt, "relax.completion_tokens": len(node.token_ids),
                  "relax.finish_reason": node.finish_reason or "", "relax.aborts": node.abort_count}
    if versions and versions[0] != versions[-1]:
        attributes["relax.first_weight_version"] = versions[0]
    return SpanRecord("turn", start, start + _ms(timing.total_ms), attributes,
                      _turn_parts(start, timing.pieces, base))


def _turn_parts(start: int, pieces: Sequence[GenerationPiece], base: dict[str, AttributeValue]
                ) -> tuple[SpanRecord, ...]:
    """queue, then per engine call prefill and decode; a call after a preemption is abort (parked) + resume."""
    if not pieces:
        return ()
    parts = [SpanRecord("queue", start, start + _ms(pieces[0].start_ms), base)]
    parts += _generation(start, pieces[0], base)
    for before, piece in zip(pieces, pieces[1:], strict=False):
        parts.append(SpanRecord("abort", start + _ms(before.end_ms), start + _ms(piece.start_ms), base))
        parts.append(SpanRecord("resume", start + _ms(piece.start_ms), start + _ms(piece.end_ms), base,
                                tuple(_generation(start, piece, base))))
    return tuple(parts)


def _generation(start: int, piece: GenerationPiece, base: dict[str, AttributeValue]) -> list[SpanRecord]:
    """prefill (to the first token) and decode of one engine call; decode alone when the engine gave no first
    token time (marked `relax.prefill_included`)."""
    begin, end = start + _ms(piece.start_ms), start + _ms(piece.end_ms)
    if piece.first_token_ms is None:
        return [SpanRecord("decode", begin, end, {**base, "relax.prefill_included": True})]
    first = min(max(start + _ms(piece.first_token_ms), begin), end)
    return [SpanRecord("prefill", begin, first, base), SpanRecord("decode", first, end, base)]


def _gaps(created: int, exited: int, turns: list[SpanRecord], base: dict[str, AttributeValue]) -> list[SpanRecord]:
    """The agent's own time: every part of [created, exited] no turn covers."""
    gaps, cursor = [], created
    for turn in sorted(turns, key=lambda t: t.start_ns):
        if turn.start_ns > cursor:
            gaps.append(SpanRecord("agent_gap", cursor, turn.start_ns, base))
        cursor = max(cursor, turn.end_ns)
    if exited > cursor:
        gaps.append(SpanRecord("agent_gap", cursor, exited, base))
    return gaps


def _stages(marks: dict[str, float], exited: int, base: dict[str, AttributeValue]) -> list[SpanRecord]:
    """export (exited → exported), reward (scoring → scored), credit (scored → credited), where they happened."""
    spans = []
    for name, first, last, begin in (("export", "exited", "exported", exited), ("reward", "scoring", "scored", None),
                                     ("credit", "scored", "credited", None)):
        if last in marks and (first in marks or begin is not None):
            start = _ns(marks[first]) if first in marks else begin
            spans.append(SpanRecord(name, start, max(start, _ns(marks[last])), base))
    return spans


def _train(group: Group, session: Session, train: TrainTiming, base: dict[str, AttributeValue]) -> SpanRecord | None:
    """The training step with the micro-batches that held the session's samples; None when none was trained."""
    mine = {id(c.sample) for c in group.contexts if c.session_id == session.id and c.advantage is not None}
    if group.excluded or not mine:
        return None
    batches = tuple(SpanRecord("micro_batch", m.start_ns, m.end_ns,
                               {**base, "relax.optimizer_step": m.optimizer_step, "relax.micro_batch": m.index,
                                "relax.samples": len(mine & m.samples)})
                    for m in train.micro_batches if mine & m.samples)
    attributes = {**base, "relax.weight_version": train.version, "relax.samples": len(mine)}
    return SpanRecord("train_step", train.start_ns, train.end_ns, attributes, batches)


def _ns(seconds: float) -> int:
    return round(seconds * NS)


def _ms(milliseconds: float) -> int:
    return round(milliseconds * 1_000_000)


def train_timing(start_ns: int, end_ns: int, version: int, timeline: Sequence[Sequence[Any]]) -> TrainTiming:
    """The step's `TrainTiming` from the loop's clock and the trainer's `timeline` (one list of
    `train.provenance.MicroBatchTime` per optimizer step)."""
    batches = tuple(MicroBatchTiming(step, m.index, m.start_ns, m.end_ns, frozenset(map(id, m.samples)))
                    for step, micro in enumerate(timeline) for m in micro)
    return TrainTiming(start_ns, end_ns, version, batches)
