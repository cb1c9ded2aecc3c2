"""Transfer stage: scored contexts → training samples and rollout-dump rows (docs/design.md §3.4).

A healthy group yields one row per exported context, with status `completed` (or `truncated` when its
last turn hit the length limit); a dropped group yields one row per session saying why (`failed` for
the session that failed, `dropped` for its siblings), and a group its credit filtered (`credit.base.filter_group`)
one row per session with status `filtered`, `error` null (the reason is in the log), the `reward` its first
scored context got (what the filter saw) and `advantage` null, so nothing is lost silently. Every row names its
session's one `outcome` (`stages/group.py`); a truncated row whose agent failed after the cut keeps that
failure in `error`. Rows follow the dump schema exactly; writing them is `tracking/dump.py`'s job.

Rows of samples with images keep the schema (`tokens` are the processor-expanded training ids) and add
`multimodal: {"image_grid_thw", "image_tokens"}`; their messages carry image parts whose data URIs are
replaced by the image's digest (`data:elided;blake2b=...`), so a dump never holds pixels or base64.

`timing` holds the session's marks (epoch seconds of `created`, `running`, `exited`, ...), `agent_s`, and, on
context rows, `turns`: one `{"queue_ms", "generation_ms", "total_ms"}` per generated turn of the context, in
order (`forest.store.TurnTiming`).
"""

from __future__ import annotations

from typing import Any

from relax_pipeline.credit.records import CreditContext
from relax_pipeline.stages.group import Group, session_outcome
from relax_pipeline.turn.sessions import ForestStore, Session, Status


class Transfer:
    """Closes a group's sessions and lays out its samples as dump rows."""

    def __init__(self, store: ForestStore) -> None:
        self.store = store

    def run(self, group: Group) -> list[dict[str, Any]]:
        if group.excluded:
            return [self._failed_row(group, s) for s in group.sessions]
        rows = [self._row(group, c) for c in group.contexts]
        for session in group.sessions:
            self.store.set_status(session, Status.TRUNCATED if _truncated(group, session) else Status.COMPLETED)
        return rows

    def _row(self, group: Group, context: CreditContext) -> dict[str, Any]:
        sample, session = context.sample, group.sessions[context.slot]
        row = _base(group, session, "truncated" if sample.truncated else "completed", group.truncated.get(session.id),
                    "truncated" if _truncated(group, session) else "completed")
        row.update(
            name=context.name, branch=context.branch, reward=context.reward, advantage=context.advantage,
            metadata=context.metadata,
            messages=[m.to_openai(inline_media=False) for m in sample.messages],
            tools=[dict(t) for t in sample.context.tools],
            chat_template_kwargs=sample.context.kwargs(), state_hash=sample.state_hash,
            tokens=list(sample.tokens), loss_mask=list(sample.loss_mask),
            rollout_logprobs=list(sample.rollout_logprobs), weight_versions=list(sample.weight_versions),
            prompt_length=sample.prompt_length, response_length=sample.response_length,
            turn_count=sample.turn_count, abort_count=sample.abort_count,
        )
        row["timing"]["turns"] = [t.as_dict() if t else None for t in sample.turn_timings]
        if sample.image_grid_thw:
            row["multimodal"] = {"image_grid_thw": [list(g) for g in sample.image_grid_thw],
                                 "image_tokens": list(sample.image_tokens)}
        return row

    def _failed_row(self, group: Group, session: Session) -> dict[str, Any]:
        if not session.status.terminal:
            status = Status.FILTERED if group.filtered else Status.DROPPED
            self.store.set_status(session, status, group.excluded)
        error = None if session.status is Status.FILTERED else session.error or group.excluded
        row = _base(group, session, session.status.value, error, session_outcome(group, session))
        row.update(
            name=None, branch=None, reward=_scored_reward(group, session), advantage=None,
            metadata=group.prompt.metadata, messages=[],
            tools=[],
            chat_template_kwargs={}, state_hash=None, tokens=[], loss_mask=[], rollout_logprobs=[],
            weight_versions=[], prompt_length=0, response_length=0,
            turn_count=session.forest.turn_count, abort_count=session.abort_count,
        )
        return row


def _scored_reward(group: Group, session: Session) -> Any:
    """The reward of the session's first scored context in a filtered group; None otherwise."""
    if not group.filtered or group.dropped:
        return None
    return next((c.reward for c in group.contexts if c.session_id == session.id), None)


def _truncated(group: Group, session: Session) -> bool:
    """A context of the session ends on a turn cut by the length limit (the session ends `truncated`)."""
    return any(c.sample.truncated for c in group.contexts if c.session_id == session.id)


def _base(group: Group, session: Session, status: str, error: str | None, outcome: str) -> dict[str, Any]:
    return {
        "rollout_id": group.rollout_id, "group_id": group.id, "session_id": session.id, "index": session.index,
        "mode": group.mode, "status": status, "outcome": outcome, "error": error,
        "timing": _timing(session),
    }


def _timing(session: Session) -> dict[str, Any]:
    marks = dict(session.timing)
    start = marks.get("running", marks.get("created", 0.0))
    end = marks.get("exited") or max(marks.values(), default=start)
    marks["agent_s"] = round(max(0.0, end - start), 4)
    return marks
