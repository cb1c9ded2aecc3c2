"""History policy, fork diagnostics and forked-session export (real turn service, template and tokenizer;
scripted engine).

Harnesses that drop the returned `reasoning_content` (openai-agents and LangChain on Chat) re-send every
assistant turn without it: under `rollout.history=tokens` the session stays linear and every turn's prompt
starts with exactly what was generated; under `render` it forks, the fork is described, and implicit export
takes every root-to-leaf chain with each generated turn trained once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.agent.session_io import AgentOutput
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.credit.reward import RewardCredit
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.forest.export import ExportError, implicit_export, implicit_exports
from relax_pipeline.forest.sample import build_sample
from relax_pipeline.forest.store import SessionForest
from relax_pipeline.protocol.chat import parse_request
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore

THOUGHT = "<think>\nLet me add.\n</think>\n\n"
SCRIPT = [THOUGHT + "It is 3.", THOUGHT + "Still 3.", THOUGHT + "Yes."]
USER = {"role": "user", "content": "What is 1 + 2?"}
pytestmark = pytest.mark.asyncio


def service(template: ChatTemplate, history: str) -> TurnService:
    return TurnService(template, ScriptedEngine(template.tokenizer, SCRIPT), OutputParser(), SamplingDefaults(),
                       history)


async def dropping_reasoning(svc: TurnService, forest: SessionForest, turns: int = 3) -> list[Any]:
    """A harness that re-sends each assistant turn with its content only (reasoning dropped)."""
    messages: list[dict[str, Any]] = [USER]
    results = []
    for i in range(turns):
        result = await svc.run(forest, parse_request({"messages": messages}))
        assert result.message.reasoning_content, "the engine's answer carries reasoning"
        results.append(result)
        messages += [{"role": "assistant", "content": result.message.content}, {"role": "user", "content": f"{i}?"}]
    return results


async def test_tokens_policy_keeps_a_reasoning_dropping_session_linear(template: ChatTemplate) -> None:
    svc, forest = service(template, "tokens"), SessionForest()
    await dropping_reasoning(svc, forest)
    assert len(forest.leaves()) == 1 and forest.forks == []
    prompts = svc.engine.prompts
    for turn in range(1, 3):
        generated = [n for n in forest.nodes if n.kind == "response"][turn - 1]
        assert prompts[turn][: len(prompts[turn - 1])] == prompts[turn - 1], "each prompt extends the last"
        start = len(prompts[turn - 1])
        assert prompts[turn][start: start + len(generated.token_ids)] == list(generated.token_ids), \
            "the model sees exactly what it generated, reasoning included"


async def test_render_policy_forks_and_the_fork_names_turn_message_and_field(
        template: ChatTemplate, caplog: pytest.LogCaptureFixture) -> None:
    svc, forest = service(template, "render"), SessionForest()
    caplog.set_level(logging.INFO, logger="relax_pipeline.turn.service")
    await dropping_reasoning(svc, forest)
    assert len(forest.leaves()) == 3 and len(forest.forks) == 2
    first = forest.forks[0]
    assert first.message_index == 1 and first.differed == ("reasoning_content",) and first.role == "assistant"
    assert "re-sent assistant message 1 differs in reasoning_content" in first.describe()
    lines = [r.getMessage() for r in caplog.records if "forked" in r.getMessage()]
    assert len(lines) == 2 and "turn 2 forked" in lines[0]
    with pytest.raises(ExportError, match="Forks: re-sent assistant message 1 differs in reasoning_content"):
        implicit_export(forest)


async def two_follow_ups(svc: TurnService, forest: SessionForest) -> None:
    """One turn, then two different follow-ups after it (a harness that rewrote its last observation)."""
    first = await svc.run(forest, parse_request({"messages": [USER]}))
    for follow_up in ("Sure?", "Explain."):
        messages = [USER, first.message.to_openai(), {"role": "user", "content": follow_up}]
        await svc.run(forest, parse_request({"messages": messages}))


async def test_leaves_export_trains_each_generated_turn_once(template: ChatTemplate) -> None:
    svc, forest = service(template, "tokens"), SessionForest()
    await two_follow_ups(svc, forest)
    chains = implicit_exports(forest, "leaves")
    first_response = next(n.id for n in forest.nodes if n.kind == "response")
    assert [c.branch for c in chains] == [0, 1]
    assert chains[0].shared == frozenset() and chains[1].shared == {first_response}
    samples = [build_sample(forest, c.node, c.shared) for c in chains]
    trained = [sum(s.loss_mask) for s in samples]
    generated = sum(len(n.token_ids) for n in forest.nodes if n.kind == "response")
    assert sum(trained) == generated, "every generated token carries loss in exactly one chain"


async def test_strict_export_refuses_a_forked_session(template: ChatTemplate) -> None:
    svc, forest = service(template, "render"), SessionForest()
    await dropping_reasoning(svc, forest, turns=2)
    with pytest.raises(ExportError, match="2 leaves"):
        implicit_exports(forest, "strict")


async def test_chains_of_a_forked_session_share_its_credit_and_carry_their_branch(template: ChatTemplate) -> None:
    store = ForestStore()
    group = Group("g0", Prompt(0, "What is 1 + 2?", {}), 0, "train", Path("unused"))
    for index, reward in enumerate([1.0, 0.0]):
        session = store.open(group.id, index, 0, "train", {"messages": [USER]})
        group.sessions.append(session)
        if index == 0:
            await two_follow_ups(service(template, "tokens"), session.forest)
        else:
            await dropping_reasoning(service(template, "tokens"), session.forest, turns=2)
        group.outputs[session.id] = AgentOutput(True, (), reward, {})
    exports = {s.id: implicit_exports(s.forest, "leaves") for s in group.sessions}
    await Reward(store, RewardCredit(CreditSettings())).run(group, exports)
    rows = Transfer(store).run(group)
    assert [(r["index"], r["branch"]) for r in rows] == [(0, 0), (0, 1), (1, None)]
    forked, linear = [r for r in rows if r["index"] == 0], rows[2]
    assert forked[0]["advantage"] == forked[1]["advantage"] > 0 > linear["advantage"]
    assert sum(forked[1]["loss_mask"]) < forked[1]["response_length"]
