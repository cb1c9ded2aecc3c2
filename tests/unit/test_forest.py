"""SessionForest: canonical matching, branches and forks, exports, samples and the template invariant.

Turns go through the real TurnService, chat parser, chat template and tokenizer; only the engine is
scripted (relax_pipeline.testing.engines), so every generated token is known.
"""

from __future__ import annotations

import json
from array import array

import pytest
import torch

from relax_pipeline.canonical.form import Context, canonical_arguments, chain_all, parse_messages
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.forest.export import ExportError, ExportRecord, explicit_exports, implicit_export
from relax_pipeline.forest.sample import build_sample, token_table
from relax_pipeline.forest.store import SessionForest, logprob_array
from relax_pipeline.models.tiny import QWEN3_DROP_REASONING_TEMPLATE
from relax_pipeline.protocol.chat import parse_request
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]


def service(template: ChatTemplate, script: list[str], **defaults: int) -> TurnService:
    engine = ScriptedEngine(template.tokenizer, script)
    return TurnService(template, engine, OutputParser(), SamplingDefaults(**defaults))


async def turn(svc: TurnService, forest: SessionForest, messages: list[dict], tools: list | None = TOOLS):
    return await svc.run(forest, parse_request({"messages": messages, "tools": tools}))


async def three_turns(svc: TurnService, forest: SessionForest) -> list[dict]:
    messages = list(START)
    first = await turn(svc, forest, messages)
    messages += [first.message.to_openai(), {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    second = await turn(svc, forest, messages)
    messages += [second.message.to_openai(), {"role": "user", "content": "Sure?"}]
    third = await turn(svc, forest, messages)
    return messages + [third.message.to_openai()]


def test_python_and_javascript_arguments_hash_the_same() -> None:
    python = json.dumps({"a": 1, "b": [1, 2], "c": {"y": 1, "x": "é"}})
    javascript = '{"c":{"x":"é","y":1},"b":[1,2],"a":1}'
    assert canonical_arguments(python, "p") == canonical_arguments(javascript, "p")
    make = lambda args: parse_messages([{"role": "assistant", "content": None, "tool_calls": [  # noqa: E731
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": args}}]}])
    assert chain_all(Context(), make(python)) == chain_all(Context(), make(javascript))


@pytest.mark.asyncio
async def test_replayed_history_with_js_arguments_extends_the_lineage(template: ChatTemplate) -> None:
    svc, forest = service(template, [CALL, "It is 3."]), SessionForest()
    first = await turn(svc, forest, START)
    replay = first.message.to_openai()
    replay["tool_calls"][0]["function"]["arguments"] = '{"b":"x","a":1}'
    await turn(svc, forest, START + [replay, {"role": "tool", "tool_call_id": "c1", "content": "3"}])
    assert len(forest.leaves()) == 1 and not forest.forks
    assert [n.kind for n in forest.nodes] == ["root", "observation", "response", "observation", "response"]


@pytest.mark.asyncio
async def test_each_turn_prompt_starts_with_the_lineage(template: ChatTemplate) -> None:
    svc, forest = service(template, [CALL, "It is 3.", "Yes."]), SessionForest()
    await three_turns(svc, forest)
    prompts = svc.engine.prompts
    responses = [n for n in forest.nodes if n.kind == "response"]
    for i in (1, 2):
        previous = prompts[i - 1] + list(responses[i - 1].token_ids)
        assert prompts[i][: len(previous)] == previous


@pytest.mark.asyncio
async def test_linear_sample_decodes_to_the_full_render(template: ChatTemplate) -> None:
    svc, forest = service(template, [CALL, "It is 3.", "Yes."]), SessionForest()
    messages = await three_turns(svc, forest)
    sample = build_sample(forest, implicit_export(forest).node)
    assert template.render_differences(sample.tokens, sample.messages, sample.context) is None
    full = template.render(parse_messages(messages), Context(tuple(TOOLS)), generation_prompt=False)
    assert template.tokenizer.decode(list(sample.tokens)) == full.rstrip("\n")
    _check_invariants(sample)


def _check_invariants(sample) -> None:  # noqa: ANN001
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.weight_versions)
    assert len(sample.loss_mask) == sample.response_length
    for mask, logprob in zip(sample.loss_mask, sample.rollout_logprobs, strict=True):
        assert logprob == (-0.5 if mask else 0.0)


@pytest.mark.asyncio
async def test_history_rewriting_template_is_reported(tokenizer) -> None:  # noqa: ANN001
    from copy import deepcopy

    rewriting = deepcopy(tokenizer)
    rewriting.chat_template = QWEN3_DROP_REASONING_TEMPLATE
    template = ChatTemplate(rewriting)
    svc, forest = service(template, [CALL, "It is 3.", "Yes."]), SessionForest()
    await three_turns(svc, forest)
    sample = build_sample(forest, implicit_export(forest).node)
    difference = template.render_differences(sample.tokens, sample.messages, sample.context)
    assert difference is not None and "</think>" in difference.sample_text


@pytest.mark.asyncio
async def test_retry_of_the_same_state_branches(template: ChatTemplate) -> None:
    svc, forest = service(template, ["First try.", "Second try."]), SessionForest()
    await turn(svc, forest, START)
    await turn(svc, forest, START)
    observation = forest.nodes[1]
    assert [forest.nodes[c].kind for c in forest.children[observation.id]] == ["response", "response"]
    assert not forest.forks
    assert svc.engine.prompts[0] == svc.engine.prompts[1]


@pytest.mark.asyncio
async def test_divergent_history_branches_and_records_the_fork(template: ChatTemplate) -> None:
    svc, forest = service(template, [CALL, "A.", "B."]), SessionForest()
    first = await turn(svc, forest, START)
    base = START + [first.message.to_openai()]
    await turn(svc, forest, base + [{"role": "tool", "tool_call_id": "c1", "content": "3"}])
    await turn(svc, forest, base + [{"role": "tool", "tool_call_id": "c1", "content": "4"}])
    assert len(forest.forks) == 1
    fork = forest.forks[0]
    assert fork.message_index == 3 and fork.differed == ("content",)
    assert fork.parent_node == forest.nodes[2].id
    assert len(forest.leaves()) == 2


@pytest.mark.asyncio
async def test_implicit_export_of_a_branched_session_names_both_leaves(template: ChatTemplate) -> None:
    svc, forest = service(template, ["One.", "Two."]), SessionForest()
    await turn(svc, forest, START)
    await turn(svc, forest, START[:1] + [{"role": "user", "content": "Other question"}])
    with pytest.raises(ExportError) as error:
        implicit_export(forest)
    leaves = forest.leaves()
    assert f"node {leaves[0].id}" in str(error.value) and f"node {leaves[1].id}" in str(error.value)
    assert "explicit record" in str(error.value)


@pytest.mark.asyncio
async def test_explicit_export_of_both_branches_gives_two_samples(template: ChatTemplate) -> None:
    svc, forest = service(template, ["One.", "Two."]), SessionForest()
    a = await turn(svc, forest, START)
    other = START[:1] + [{"role": "user", "content": "Other question"}]
    b = await turn(svc, forest, other)
    records = [
        ExportRecord("a", START + [a.message.to_openai()], TOOLS, None, {}, 1.0),
        ExportRecord("b", other + [b.message.to_openai()], TOOLS, None, {}, 0.0),
    ]
    exported = explicit_exports(forest, records)
    samples = [build_sample(forest, e.node) for e in exported]
    assert [e.name for e in exported] == ["a", "b"]
    assert samples[0].tokens != samples[1].tokens
    assert all(s.turn_count == 1 for s in samples)


@pytest.mark.asyncio
async def test_unmatched_explicit_record_names_where_it_diverged(template: ChatTemplate) -> None:
    svc, forest = service(template, ["One."]), SessionForest()
    result = await turn(svc, forest, START)
    edited = dict(result.message.to_openai(), content="Edited.")
    with pytest.raises(ExportError, match=r"messages\[2\] differs from committed assistant message"):
        explicit_exports(forest, [ExportRecord("main", START + [edited], TOOLS, None, {}, None)])
    with pytest.raises(ExportError, match="tools/chat_template_kwargs match no request"):
        explicit_exports(forest, [ExportRecord("main", START, None, None, {}, None)])


@pytest.mark.asyncio
async def test_explicit_record_without_a_generated_turn_is_refused(template: ChatTemplate) -> None:
    svc, forest = service(template, ["One."]), SessionForest()
    await turn(svc, forest, START)
    with pytest.raises(ExportError, match="export record 'main': .* holds no generated token"):
        explicit_exports(forest, [ExportRecord("main", START, TOOLS, None, {}, None)])


@pytest.mark.asyncio
async def test_length_cut_turn_is_closed_by_the_next_delta(template: ChatTemplate) -> None:
    svc, forest = service(template, ["a b c d e f g h i j k l", "Done."], max_response_len=4), SessionForest()
    first = await turn(svc, forest, START)
    assert first.finish_reason == "length"
    await turn(svc, forest, START + [first.message.to_openai(), {"role": "user", "content": "Go on."}])
    sample = build_sample(forest, implicit_export(forest).node)
    first_response = forest.nodes[2]
    observation = forest.nodes[3]
    assert not first_response.ends_turn
    assert tuple(observation.token_ids[: len(template.end_of_turn_ids)]) == template.end_of_turn_ids
    start = first_response.token_ids
    offset = len(start)
    assert sample.loss_mask[:offset] == (1,) * offset and sample.loss_mask[offset] == 0
    print(token_table(sample, template.tokenizer))


@pytest.mark.asyncio
@pytest.mark.parametrize("logprob", [-0.1, float(torch.tensor(-0.1, dtype=torch.float32))])
async def test_token_fields_are_compact_and_logprobs_round_trip(template: ChatTemplate, logprob: float) -> None:
    engine = ScriptedEngine(template.tokenizer, [CALL, "It is 3.", "Yes."], logprob=logprob)
    svc, forest = TurnService(template, engine, OutputParser(), SamplingDefaults()), SessionForest()
    await three_turns(svc, forest)
    fields = [getattr(n, f) for n in forest.nodes for f in ("token_ids", "logprobs", "weight_versions", "train_ids")]
    assert all(isinstance(values, array) for values in fields)
    tokens = sum(len(n.token_ids) for n in forest.nodes)
    assert sum(len(values) * values.itemsize for values in fields) / tokens <= 64
    responses = [n for n in forest.nodes if n.kind == "response"]
    assert all(list(n.logprobs) == [logprob] * len(n.token_ids) for n in responses)
    assert {n.logprobs.typecode for n in responses} == {"d" if logprob == -0.1 else "f"}
    sample = build_sample(forest, implicit_export(forest).node)
    assert {lp for lp, mask in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if mask} == {logprob}
    assert forest.turn_count == len(responses) == 3


def test_engine_float32_logprobs_are_stored_as_float32_and_others_as_float64() -> None:
    from_engine = torch.randn(257).log_softmax(0).tolist()
    assert logprob_array(from_engine).typecode == "f" and logprob_array(from_engine).tolist() == from_engine
    odd = [-0.1, float("-inf"), -1e-300, -1e300, float("nan")]
    stored = logprob_array(odd)
    assert stored.typecode == "d" and stored.tobytes() == array("d", odd).tobytes()


@pytest.mark.asyncio
async def test_prompt_ids_follow_each_lineage_when_branches_interleave(template: ChatTemplate) -> None:
    svc, forest = service(template, [CALL, "A.", "B.", "C.", "D."]), SessionForest()
    first = await turn(svc, forest, START)
    base = START + [first.message.to_openai()]
    branches = [base + [{"role": "tool", "tool_call_id": "c1", "content": str(i)}] for i in (3, 4)]
    for messages in branches + branches:  # the second round retries each branch's state
        await turn(svc, forest, messages)
    assert forest.turn_count == 5 and len(forest.leaves()) == 4
    for node in forest.nodes[::-1] + forest.nodes:
        expected = [t for step in forest.lineage(node) for t in step.token_ids]
        assert forest.prompt_ids(node) == expected
