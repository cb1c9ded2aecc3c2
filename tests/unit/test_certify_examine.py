"""The template and fork stages (`certify/examine.py`) on a session recorded by a `RecordingForest` through the real
turn service and a scripted engine: a turn re-sent without its reasoning forks under `rollout.history=render` (its
cost: the shared prefix again under `export.implicit=leaves`, the whole session under `strict`) and is absorbed
under `tokens`; the causes name the key that fixes them. The parsers stage reports tool calls it cannot read as the
model wrote them."""

from __future__ import annotations

from typing import Any

import pytest

from relax_pipeline.certify import drift
from relax_pipeline.certify.evidence import parsers_stage
from relax_pipeline.certify.examine import Causes, session_drifts, template_and_forks
from relax_pipeline.certify.sessions import RecordingForest, SessionRun
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import parse_request
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import Session

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]


async def recorded(template: ChatTemplate, history: str, drop_reasoning: bool) -> SessionRun:
    """Two turns of one session; the second re-sends the first reply (without its reasoning if asked)."""
    service = TurnService(template, ScriptedEngine(template.tokenizer, [CALL, "3"]), OutputParser(),
                          SamplingDefaults(), history)
    session = Session("sess-test", "g", 0, 0, "train", {}, forest=RecordingForest())
    messages = list(START)
    first = await service.run(session.forest, parse_request({"messages": messages, "tools": TOOLS}))
    reply: dict[str, Any] = first.message.to_openai()
    if drop_reasoning:
        reply.pop("reasoning_content")
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "3"}]
    await service.run(session.forest, parse_request({"messages": messages, "tools": TOOLS}))
    return SessionRun(session, None)  # type: ignore[arg-type] - the template and fork stages read no group


@pytest.mark.asyncio
async def test_a_verbatim_session_has_no_drift(template: ChatTemplate) -> None:
    run = await recorded(template, "render", drop_reasoning=False)
    turns = session_drifts(run, template, "leaves")
    assert [(t.cause, t.forked) for t in turns] == [(None, False), (None, False)]


@pytest.mark.asyncio
async def test_dropped_reasoning_forks_under_render_at_the_cost_of_the_shared_prefix(template: ChatTemplate) -> None:
    run = await recorded(template, "render", drop_reasoning=True)
    second = session_drifts(run, template, "leaves")[1]
    assert second.cause == drift.REASONING_DROPPED and second.forked and second.lost == 0
    shared = run.forest.nodes[run.forest.turns[1].fork.parent_node]
    assert second.duplicated == len(run.forest.prompt_ids(shared)) > 0
    strict = session_drifts(run, template, "strict")[1]
    generated = sum(len(n.token_ids) for n in run.forest.nodes if n.kind == "response")
    assert strict.duplicated == 0 and strict.lost == generated


@pytest.mark.asyncio
async def test_dropped_reasoning_is_absorbed_under_tokens(template: ChatTemplate) -> None:
    run = await recorded(template, "tokens", drop_reasoning=True)
    second = session_drifts(run, template, "leaves")[1]
    assert second.cause == drift.REASONING_DROPPED and not second.forked and second.duplicated == 0
    assert second.drift is not None and "<think>" in second.drift.held


@pytest.mark.asyncio
@pytest.mark.parametrize("history, implicit, fix", [
    ("render", "leaves", "rollout.history=tokens"),
    ("render", "strict", "export.implicit=leaves; rollout.history=tokens"),
    ("tokens", "leaves", ""),
])
async def test_the_causes_name_what_fixes_them(template: ChatTemplate, history: str, implicit: str, fix: str) -> None:
    causes = Causes(history, implicit)
    stages = template_and_forks([await recorded(template, history, drop_reasoning=True)], template, causes)
    assert [s.name for s in stages] == ["template", "forks"]
    (found,) = causes.causes()
    assert found.cause == drift.REASONING_DROPPED and found.fix == fix and found.turns == 1
    assert (found.forks == 1) == (history == "render") and 0 <= found.share < 1


@pytest.mark.asyncio
async def test_a_tool_call_whose_arguments_are_not_json_is_reported_as_written(template: ChatTemplate) -> None:
    bad = '<tool_call>\n{"name": "calc", "arguments": "{a: 1"}\n</tool_call>'
    unread = "<tool_call>\ncalc(a=1)\n</tool_call>"
    service = TurnService(template, ScriptedEngine(template.tokenizer, [bad, unread]), OutputParser(),
                          SamplingDefaults())
    session = Session("sess-test", "g", 0, 0, "train", {}, forest=RecordingForest())
    for _ in range(2):
        await service.run(session.forest, parse_request({"messages": START, "tools": TOOLS}))
    stage = parsers_stage([SessionRun(session, None)], template, OutputParser())  # type: ignore[arg-type]
    listed = stage.evidence["malformed_tool_calls"]
    assert stage.verdict == "warn" and [m["name"] for m in listed] == ["calc", None]
    assert listed[0]["arguments"] == "{a: 1" and "calc(a=1)" in listed[1]["text"]
    assert "is protocol.tool_call_parser=qwen25 the model's format?" in stage.summary
