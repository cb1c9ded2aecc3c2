"""The template and fork stages of the certificate: every committed turn's re-sent history against the forest.

For each committed turn of each checked session (`SentTurn`), the turn it continues is the session's earlier
response whose history shares the longest run of leading messages with what the agent sent (by what a harness
can see, so a turn re-sent without its reasoning still finds it). `drift.classify` compares the sent history,
rendered by the model's template, with that response's token ids (the model's own generated ids included) and
names a cause. A turn whose request forked the session (`ForkEvent`) costs tokens: under `export.implicit=leaves`
its new chain processes the shared prefix again (tokens duplicated); under `strict` the forked session is refused
(its generated tokens lost). A drift without a fork was absorbed: the forest kept the model's tokens
(`rollout.history=tokens` for dropped reasoning; the canonical form for re-serialized JSON).

`Causes` adds the turns up per cause with the key that fixes each. The other stages (sessions, parsers, export,
runtime) are `certify/evidence.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.canonical.form import Message
from relax_pipeline.certify import drift
from relax_pipeline.certify.certificate import FAIL, PASS, WARN, Cause, Stage
from relax_pipeline.certify.sessions import SentTurn, SessionRun
from relax_pipeline.chat.template import ChatTemplate

HARNESS = "harness: "
FIXES = {
    drift.REASONING_DROPPED: "rollout.history=tokens",
    drift.REASONING_REWRITTEN: HARNESS + "re-send reasoning_content as received, or leave it out "
                               "(rollout.history=tokens then reuses the turn)",
    drift.TOOL_ARGUMENTS_RESERIALIZED: "",
    drift.TOOL_ARGUMENTS_MALFORMED: HARNESS + "re-send tool-call arguments as the JSON string received (json.dumps, "
                                    "never str()); answer an unparsable call with an error tool result",
    drift.TOOL_CALL_FLATTENED: HARNESS + "re-send tool calls as structured tool_calls (tool_use blocks), not as text",
    drift.SYSTEM_PROMPT_CHANGED: HARNESS + "keep the system prompt and tools fixed within a session, or export each "
                                 "context explicitly (agent.multi_context=true)",
    drift.CONTENT_PARTS: HARNESS + "re-send content parts in the order and form received",
    drift.EDITED_REPLY: HARNESS + "send each assistant message back exactly as received (keep display edits out of "
                        "the history), or continue with previous_response_id (Responses) instead of re-sending it; "
                        "or export the edited context explicitly (agent.multi_context=true)",
    drift.WHITESPACE: HARNESS + "re-send message text unchanged (no strip or reformatting)",
    drift.TRUNCATION: HARNESS + "export each context explicitly when it trims history (agent.multi_context=true); "
                      "or raise rollout.max_response_len",
    drift.TOKENIZATION: "",
    drift.UNKNOWN: "read the first differing token in check/certificate.md",
}
"""The key or harness switch that fixes each cause when it costs tokens."""
_FORK_FIELDS = {"reasoning_content": drift.REASONING_REWRITTEN, "tool_calls": drift.TOOL_CALL_FLATTENED,
                "tools": drift.SYSTEM_PROMPT_CHANGED, "chat_template_kwargs": drift.SYSTEM_PROMPT_CHANGED}
MAX_LISTED = 20
"""Turns listed in a stage's evidence (the counts cover them all)."""


@dataclass(frozen=True)
class TurnDrift:
    """One checked turn's drift and what its fork costs."""

    session: str
    turn: int
    drift: drift.Drift | None
    cause: str | None
    forked: bool
    duplicated: int = 0
    lost: int = 0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session": self.session, "turn": self.turn, "cause": self.cause, "forked": self.forked,
                               "tokens_duplicated": self.duplicated, "tokens_lost": self.lost}
        return out | ({"first_difference": self.drift.as_dict()} if self.drift else {})


@dataclass
class Causes:
    """Turn drifts added up per cause (`Cause` records), with the run's keys to name the fixes."""

    history: str
    implicit: str
    total_tokens: int = 0
    turns: list[TurnDrift] = field(default_factory=list)

    def causes(self) -> list[Cause]:
        named = [t for t in self.turns if t.cause is not None]
        order = [c for c in drift.CAUSES if any(t.cause == c for t in named)]
        return [self._cause(c, [t for t in named if t.cause == c]) for c in order]

    def _cause(self, name: str, turns: list[TurnDrift]) -> Cause:
        forks = [t for t in turns if t.forked]
        duplicated, lost = sum(t.duplicated for t in forks), sum(t.lost for t in forks)
        first = next((t for t in turns if t.drift is not None), None)
        where = {"session": first.session, "turn": first.turn} | first.drift.as_dict() if first and first.drift else {}
        return Cause(name, len(turns), len(forks), duplicated, lost,
                     (duplicated + lost) / max(self.total_tokens, 1), self._fix(name, bool(forks), lost > 0), where)

    def _fix(self, name: str, forked: bool, lost: bool) -> str:
        if name == drift.REASONING_DROPPED and self.history == "tokens" and not forked:
            return ""
        fix = FIXES[name] if forked or name in (drift.UNKNOWN, drift.TOOL_ARGUMENTS_MALFORMED) else ""
        if lost and self.implicit == "strict":
            fix = "; ".join(f for f in ("export.implicit=leaves", fix) if f)
        return fix


def template_and_forks(runs: list[SessionRun], template: ChatTemplate, causes: Causes) -> list[Stage]:
    """The template stage (every turn's round trip) and the fork stage (every fork's cause and cost)."""
    causes.total_tokens = sum(len(n.training_ids) for r in runs for n in r.forest.nodes)
    try:
        for run in runs:
            causes.turns += session_drifts(run, template, causes.implicit)
    except Exception as error:  # noqa: BLE001 - a template that cannot render is a verdict, not a traceback
        return [Stage("template", FAIL, f"the chat template cannot render the agent's messages: {error}")]
    return [_template_stage(causes.turns), _fork_stage(causes)]


def session_drifts(run: SessionRun, template: ChatTemplate, implicit: str) -> list[TurnDrift]:
    """Each turn of one session after its first: its drift against the turn it continues, and its fork's cost."""
    forest, out = run.forest, []
    for i, turn in enumerate(forest.turns):
        found = _drift(run, template, forest.turns[:i], turn)
        cause = found.cause if found else (_fork_cause(turn) if turn.fork else None)
        duplicated, lost = _cost(run, turn, implicit, first=not any(t.forked for t in out))
        out.append(TurnDrift(run.session.id, i, found, cause, turn.fork is not None, duplicated, lost))
    return out


def _drift(run: SessionRun, template: ChatTemplate, earlier: list[SentTurn], turn: SentTurn) -> drift.Drift | None:
    forest = run.forest
    best = _continued(forest.history, earlier, turn.messages)
    if best is None:
        return None
    node = forest.nodes[best.node_id]
    return drift.classify(template, turn.messages, forest.history(node.id), forest.prompt_ids(node), turn.context,
                          held_cut=not node.ends_turn)


def _continued(history: Any, earlier: list[SentTurn], sent: tuple[Message, ...]) -> SentTurn | None:
    """The earlier turn whose committed history shares the most leading messages with `sent` (latest on a tie)."""
    best, best_n = None, 0
    for turn in earlier:
        n = _shared(history(turn.node_id), sent)
        if n >= best_n and n > 0:
            best, best_n = turn, n
    return best


def _shared(held: Iterable[Message], sent: tuple[Message, ...]) -> int:
    n = 0
    for a, b in zip(held, sent, strict=False):
        if a.visible_key() != b.visible_key() and a.role != b.role:
            break
        n += 1
    return n


def _fork_cause(turn: SentTurn) -> str:
    assert turn.fork is not None
    return next((_FORK_FIELDS[f] for f in turn.fork.differed if f in _FORK_FIELDS), drift.UNKNOWN)


def _cost(run: SessionRun, turn: SentTurn, implicit: str, first: bool) -> tuple[int, int]:
    """(tokens duplicated, generated tokens lost) by this turn's fork under `export.implicit`."""
    if turn.fork is None:
        return 0, 0
    forest = run.forest
    if implicit == "strict":  # the forked session is refused: all its generated tokens, counted once
        return 0, sum(len(n.token_ids) for n in forest.nodes if n.kind == "response") if first else 0
    parent = turn.fork.parent_node
    return (len(forest.prompt_ids(forest.nodes[parent])) if parent >= 0 else 0), 0


def _template_stage(turns: list[TurnDrift]) -> Stage:
    drifted = [t for t in turns if t.drift is not None]
    counted = Counter(t.cause for t in drifted)
    evidence = {"turns": len(turns), "exact": len(turns) - len(drifted), "drifted": dict(counted),
                "first_differences": [t.as_dict() for t in drifted[:MAX_LISTED]]}
    if not drifted:
        return Stage("template", PASS, f"all {len(turns)} turns re-render to the tokens the forest holds", evidence)
    absorbed = sum(not t.forked for t in drifted)
    return Stage("template", WARN, f"{len(drifted)} of {len(turns)} turns re-render differently "
                 f"({', '.join(f'{c}: {n}' for c, n in counted.items())}); {absorbed} absorbed without a fork",
                 evidence)


def _fork_stage(causes: Causes) -> Stage:
    forked = [t for t in causes.turns if t.forked]
    evidence = {"forks": len(forked), "rollout.history": causes.history, "export.implicit": causes.implicit,
                "tokens_duplicated": sum(t.duplicated for t in forked), "tokens_lost": sum(t.lost for t in forked),
                "tokens_exported_once": causes.total_tokens, "listed": [t.as_dict() for t in forked[:MAX_LISTED]]}
    if not forked:
        return Stage("forks", PASS, "no session forked: every chain is exported once", evidence)
    what = ("each forked session is refused (export.implicit=strict): its tokens are lost" if causes.implicit ==
            "strict" else "each fork exports one more chain, its shared prefix processed again (export.implicit="
            "leaves); every generated token is still trained once")
    return Stage("forks", WARN, f"{len(forked)} forks; {what}", evidence)
