"""The sessions, parsers, export and runtime stages of the certificate, from the checked sessions.

- sessions: how each ended; `fail` when no session committed a model turn (an agent that never calls the
  model, an engine that cannot answer), with each session's error.
- parsers: every generated turn's text parsed by the configured reasoning and tool-call parsers (what the
  forest committed) and rendered back by the template: exact, or the first difference; a tool call whose
  arguments are not valid JSON, and tool-call markup left in the text (a call the parser could not read), are
  listed as the model wrote them, never rewritten.
- export: per session, its topology (linear, leaves: one chain per fork, explicit: the agent's own records),
  that every exported context holds a generated token, that rewards are present (or a reward model scores
  them), and the loss-mask coverage: the share of generated tokens that carry loss.
- runtime: per-turn queue and generation times, each agent's active time against `agent.timeout`, and what the
  other runtime modes would change for this spread of session times.

None of these raises for what it finds; each returns one `Stage`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.certify.certificate import FAIL, PASS, WARN, Stage
from relax_pipeline.certify.sessions import SessionRun
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.forest.store import Node

MAX_LISTED = 20
_PROBE = (Message("user", "x"),)


@dataclass(frozen=True)
class RuntimeKeys:
    """The keys the runtime stage measures against; connects the check recipe's config to `runtime_stage`."""

    agent_timeout: float | None
    mode: str
    reward_model: bool
    """Whether the credit scores contexts itself (a reward model), so agents need not write rewards."""


def sessions_stage(runs: list[SessionRun]) -> Stage:
    statuses: dict[str, int] = {}
    for run in runs:
        statuses[run.session.status.value] = statuses.get(run.session.status.value, 0) + 1
    turns = sum(len(r.forest.turns) for r in runs)
    errors = [{"session": r.session.id, "error": _first_line(r.session.error or r.group.dropped)}
              for r in runs if r.session.error or r.group.dropped]
    evidence = {"sessions": len(runs), "turns": turns, "statuses": statuses, "errors": errors[:MAX_LISTED]}
    if not runs or turns == 0:
        why = errors[0]["error"] if errors else "every agent exited without a model request"
        return Stage("sessions", FAIL, f"no session committed a model turn: {why}", evidence)
    if errors:
        return Stage("sessions", WARN, f"{len(errors)} of {len(runs)} sessions failed; {turns} turns committed",
                     evidence)
    return Stage("sessions", PASS, f"{len(runs)} sessions, {turns} turns committed", evidence)


def unanswered_stage(runs: list[SessionRun], template: ChatTemplate) -> Stage | None:
    """A template stage failure when a request that never committed cannot be rendered; None otherwise."""
    for run in runs:
        for context, messages in run.forest.unanswered:
            try:
                template.prompt_ids(messages, context)
            except Exception as error:  # noqa: BLE001 - the reason is the verdict
                return Stage("template", FAIL, f"the chat template cannot render the agent's messages "
                             f"({run.session.id}): {_first_line(str(error) or type(error).__name__)}")
    return None


def parsers_stage(runs: list[SessionRun], template: ChatTemplate, parser: OutputParser) -> Stage:
    responses = [(r.session.id, n) for r in runs for n in r.forest.nodes if n.kind == "response"]
    differences = [d for sid, node in responses if (d := _round_trip(sid, node, template)) is not None]
    malformed = [m for sid, node in responses for m in _malformed(sid, node)]
    evidence = {"reasoning_parser": parser.reasoning, "tool_call_parser": parser.tool_call, "turns": len(responses),
                "exact": len(responses) - len(differences), "first_differences": differences[:MAX_LISTED],
                "malformed_tool_calls": malformed[:MAX_LISTED]}
    if not differences and not malformed:
        return Stage("parsers", PASS, f"all {len(responses)} generated turns parse and render back exactly", evidence)
    unread = sum(m["name"] is None for m in malformed)
    hint = (f"; tool-call markup left in the text of {unread} turns: is protocol.tool_call_parser="
            f"{parser.tool_call} the model's format?" if unread else "")
    return Stage("parsers", WARN, f"{len(differences)} of {len(responses)} generated turns render back differently "
                 f"after parsing; {len(malformed)} tool calls malformed (reported as written, not rewritten){hint}",
                 evidence)


def _round_trip(session: str, node: Node, template: ChatTemplate) -> dict[str, Any] | None:
    """The generated text against the template's render of the message parsed from it."""
    ids = list(node.token_ids)
    generated = template.decode(ids[:-len(template.end_of_turn_ids)] if node.ends_turn else ids)
    before = template.render(_PROBE, Context(), generation_prompt=True)
    after = template.render((*_PROBE, node.messages[0]), Context(), generation_prompt=False)
    rendered = after[len(before):].split(template.end_of_turn)[0] if after.startswith(before) else after
    if rendered == generated:
        return None
    at = next((i for i, (a, b) in enumerate(zip(generated, rendered, strict=False)) if a != b),
              min(len(generated), len(rendered)))
    return {"session": session, "node": node.id, "offset": at, "generated": generated[max(at - 30, 0): at + 40],
            "rendered": rendered[max(at - 30, 0): at + 40]}


def _malformed(session: str, node: Node) -> list[dict[str, Any]]:
    message = node.messages[0]
    out = [{"session": session, "node": node.id, "name": c.name, "arguments": c.arguments[:200]}
           for c in message.tool_calls if not _is_json(c.arguments)]
    if "<tool_call>" in message.content:
        out.append({"session": session, "node": node.id, "name": None, "text": message.content[:200]})
    return out


def export_stage(runs: list[SessionRun], keys: RuntimeKeys) -> Stage:
    rows = [row for r in runs for row in r.rows if row["status"] in ("completed", "truncated")]
    topology = {r.session.id: _topology(r.rows) for r in runs if r.rows}
    empty = [row["session_id"] for row in rows if 1 not in row["loss_mask"]]
    generated = sum(len(n.token_ids) for r in runs if r.rows for n in r.forest.nodes if n.kind == "response")
    trained = sum(sum(row["loss_mask"]) for row in rows)
    unrewarded = sum(row["reward"] is None for row in rows) if not keys.reward_model else 0
    coverage = trained / generated if generated else 0.0
    evidence = {"contexts": len(rows), "topology": topology, "contexts_without_generated_token": empty,
                "generated_tokens": generated, "tokens_with_loss": trained, "loss_mask_coverage": round(coverage, 6),
                "contexts_without_reward": unrewarded, "reward_model": keys.reward_model}
    if not rows:
        return Stage("export", FAIL, "no session exported a context to train", evidence)
    if empty:
        return Stage("export", FAIL, f"{len(empty)} exported contexts hold no generated token", evidence)
    if unrewarded or abs(coverage - 1.0) > 1e-9:
        return Stage("export", WARN, f"loss-mask coverage {coverage:.1%}; {unrewarded} contexts without a reward",
                     evidence)
    return Stage("export", PASS, f"{len(rows)} contexts; every generated token carries loss once", evidence)


def _topology(rows: list[dict[str, Any]]) -> str:
    if any(row.get("name") is not None for row in rows):
        return "explicit"
    return "leaves" if len(rows) > 1 else "linear"


def runtime_stage(runs: list[SessionRun], keys: RuntimeKeys) -> Stage:
    timings = [n.timing for r in runs for n in r.forest.nodes if n.kind == "response" and n.timing is not None]
    active = [t for r in runs if (t := _active_s(r)) is not None]
    evidence: dict[str, Any] = {"turns": len(timings), "runtime": keys.mode, "agent.timeout": keys.agent_timeout}
    evidence |= _spread("queue_ms", [t.queue_ms for t in timings]) | _spread("generation_ms",
                                                                           [t.generation_ms for t in timings])
    evidence |= _spread("agent_active_s", active)
    tail = max(active) / statistics.median(active) if active and statistics.median(active) > 0 else 1.0
    evidence["long_tail_ratio"] = round(tail, 3)
    evidence["modes"] = _modes(tail)
    near = keys.agent_timeout is not None and any(a > 0.5 * keys.agent_timeout for a in active)
    if near:
        return Stage("runtime", WARN, f"a session used over half of agent.timeout={keys.agent_timeout}s", evidence)
    return Stage("runtime", PASS, f"{len(timings)} turns timed; slowest session {max(active, default=0):.1f}s "
                 f"(agent.timeout={keys.agent_timeout})", evidence)


def _active_s(run: SessionRun) -> float | None:
    marks = run.session.timing
    start, end = marks.get("running") or marks.get("waiting"), marks.get("exited")
    return end - start if start is not None and end is not None else None


def _spread(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{name}_mean": round(statistics.fmean(values), 3), f"{name}_max": round(max(values), 3)}


def _modes(tail: float) -> str:
    if tail > 2:
        return (f"the slowest session takes {tail:.1f}x the median: runtime=partial or fully_async keeps long "
                "sessions running across steps instead of holding each step for them")
    return "sessions take similar times: runtime=sync wastes little; prelaunch hides agent start-up"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""
