"""The Responses front-end over real HTTP: the real `openai` SDK (strict response validation) against the
real gateway serving Chat Completions and Responses side by side; only the engine is scripted.

Covered: a tool conversation replayed in full (reasoning + function_call + function_call_output items)
that lands on one linear branch, the same conversation continued through Chat Completions on the same
lineage, Buffered SSE with and without tools (event order, sequence numbers, heartbeats, failure), the
`incomplete` status on the token limit, and bad inputs answering 400 with the field path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from test_gateway import (
    ANSWER,
    THINK_AND_CALL,
    TOOLS,
    Gateway,
    assert_openai_error,
    generated_ids,
    kinds,
    running_gateway,
)

from relax_pipeline.engine.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import FailingEngine, ScriptedEngine
from relax_pipeline.turn.sessions import Session

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}, {"type": "web_search"}]
SYSTEM = "You add numbers."
USER = {"role": "user", "content": "What is 1 plus one?"}
REASONING = "The user wants x plus one."
IGNORED = {"include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "store": False,
           "reasoning": {"effort": "low"}, "text": {"verbosity": "low"}, "tool_choice": "auto",
           "parallel_tool_calls": False, "metadata": {"a": "b"}, "temperature": 0.3, "top_p": 0.5}


@asynccontextmanager
async def responses_gateway(template: ChatTemplate, engine: ScriptedEngine, heartbeat_s: float = 15.0
                            ) -> AsyncIterator[Gateway]:
    """The real app serving Chat Completions and Responses, under the real server."""
    frontends = [ChatFrontend(), ResponsesFrontend()]
    async with running_gateway(template, engine, heartbeat_s=heartbeat_s, frontends=frontends) as gw:
        yield gw


def strict_sdk(gw: Gateway, session: Session) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.id, max_retries=0,
                              _strict_response_validation=True)


def assert_one_branch(session: Session, turns: int) -> None:
    assert kinds(session) == ["root"] + ["observation", "response"] * turns
    assert [n.parent for n in session.forest.nodes] == [None, *range(2 * turns)]
    assert session.forest.forks == []


# --- multi-turn ---------------------------------------------------------------------------------


async def test_tool_conversation_replayed_in_full_stays_on_one_branch(template: ChatTemplate, tokenizer: Any
                                                                      ) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client:
            first = await client.responses.create(model="policy", instructions=SYSTEM, input=[USER],
                                                  tools=FLAT_TOOLS, extra_body=IGNORED)
            gen0 = generated_ids(tokenizer, THINK_AND_CALL)
            assert first.model == "policy" and first.status == "completed" and first.incomplete_details is None
            assert [item.type for item in first.output] == ["reasoning", "function_call"]
            assert first.output[0].summary[0].text == REASONING
            call = first.output[1]
            assert call.name == "calc" and json.loads(call.arguments) == {"x": 1}
            assert call.call_id == session.forest.nodes[2].messages[0].tool_calls[0].id
            assert first.usage.input_tokens == len(engine.prompts[0])
            assert first.usage.output_tokens == len(gen0)
            assert first.usage.total_tokens == len(engine.prompts[0]) + len(gen0)

            replay = [USER, *[item.model_dump(exclude_none=True) for item in first.output],
                      {"type": "function_call_output", "call_id": call.call_id,
                       "output": [{"type": "input_text", "text": "2"}]}]
            second = await client.responses.create(model="policy", instructions=SYSTEM, input=replay,
                                                   tools=FLAT_TOOLS, extra_body=IGNORED)
    assert second.output_text == ANSWER and [item.type for item in second.output] == ["message"]
    assert second.usage.input_tokens == len(engine.prompts[1])
    assert engine.prompts[1][: len(engine.prompts[0]) + len(gen0)] == engine.prompts[0] + gen0
    assert_one_branch(session, 2)
    assert session.forest.nodes[3].messages[0].tool_call_id == call.call_id


async def test_responses_then_chat_extend_one_lineage(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client:
            first = await client.responses.create(model="m", instructions=SYSTEM, input=[USER], tools=FLAT_TOOLS)
            call = first.output[1]
            history = [{"role": "system", "content": SYSTEM}, USER,
                       {"role": "assistant", "content": None, "reasoning_content": REASONING,
                        "tool_calls": [{"id": call.call_id, "type": "function",
                                        "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "2"}]
            second = await client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == ANSWER
    assert_one_branch(session, 2)
    gen0 = generated_ids(tokenizer, THINK_AND_CALL)
    assert engine.prompts[1][: len(engine.prompts[0]) + len(gen0)] == engine.prompts[0] + gen0


async def test_chat_then_responses_extend_one_lineage(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client:
            first = await client.chat.completions.create(
                model="m", messages=[{"role": "system", "content": SYSTEM}, USER], tools=TOOLS)
            call = first.choices[0].message.tool_calls[0]
            replay = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER["content"]}]},
                      {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
                          {"type": "reasoning_text", "text": REASONING}]},
                      {"type": "function_call", "call_id": call.id, "name": "calc", "arguments": '{"x": 1}'},
                      {"type": "function_call_output", "call_id": call.id, "output": "2"}]
            second = await client.responses.create(model="m", input=replay, tools=FLAT_TOOLS)
    assert second.output_text == ANSWER
    assert_one_branch(session, 2)
    assert session.forest.nodes[1].messages[0].role == "system"


# --- streaming ----------------------------------------------------------------------------------


async def sdk_events(gw: Gateway, session: Session, **request: Any) -> list[Any]:
    async with strict_sdk(gw, session) as client:
        stream = await client.responses.create(model="m", stream=True, **request)
        return [event async for event in stream]


async def test_stream_without_tools(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        events = await sdk_events(gw, session, input="hello")
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    final = events[-1].response
    assert final.status == "completed" and final.output_text == ANSWER
    assert events[3].item == final.output[0] and events[3].output_index == 0
    assert final.usage.output_tokens == len(generated_ids(tokenizer, ANSWER))
    assert session.forest.turn_count == 1


async def test_stream_with_tools(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        events = await sdk_events(gw, session, input=[USER], tools=FLAT_TOOLS)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "function_call")]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output == [e.item for e in done]
    assert final.output[1].call_id == session.forest.nodes[2].messages[0].tool_calls[0].id


async def test_stream_heartbeats_and_raw_frames(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER], delay_s=0.35)
    async with responses_gateway(template, engine, heartbeat_s=0.1) as gw:
        text = await gw.post_stream(gw.open_session(), {"input": "hello", "stream": True}, "v1/responses")
    assert text.startswith("event: response.created\ndata: {")
    assert text.count(": ping\n\n") >= 2
    frames = [f for f in text.split("\n\n") if f.startswith("event: ")]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names == [json.loads(f.split("\ndata: ", 1)[1])["type"] for f in frames]
    assert names[-1] == "response.completed"


async def test_stream_failure_is_a_failed_response(template: ChatTemplate, tokenizer: Any) -> None:
    engine = FailingEngine(tokenizer, ["never"])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        events = await sdk_events(gw, session, input="hello")
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].sequence_number == 2
    assert "engine worker died" in events[-1].response.error.message
    assert session.forest.nodes == []


# --- token limit --------------------------------------------------------------------------------


async def test_length_is_incomplete(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["a long answer that will not fit", "a long answer that will not fit"])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client:
            reply = await client.responses.create(model="m", input="hi", max_output_tokens=2)
        events = await sdk_events(gw, session, input="hi", max_output_tokens=2)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 2 and reply.output[0].status == "incomplete"
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert session.forest.nodes[2].sampling.max_new_tokens == 2


# --- bad inputs ---------------------------------------------------------------------------------

IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "full conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, IMAGE]}]},
     "input[0].content[1]", "text-only"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
    ({"input": "hi", "max_output_tokens": "10"}, "max_output_tokens", "positive integer"),
    ({"input": ""}, "input", "non-empty"),
    ({"input": []}, "input", "non-empty"),
    ({}, "input", "non-empty"),
    ({"input": [USER, {"type": "item_reference", "id": "msg_1"}]}, "input[1].type", "item_reference"),
    ({"input": [USER, {"role": "tool", "content": "x"}]}, "input[1].role", "developer"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "name": "calc", "arguments": 3},
                {"type": "function_call_output", "call_id": "c", "output": "2"}]}, "input[1].arguments", "JSON"),
    ({"input": [USER, {"type": "function_call", "call_id": "c", "name": "calc", "arguments": "{}"},
                {"type": "function_call_output", "output": "2"}]}, "input[2].call_id", "call_id"),
    ({"input": "hi", "instructions": 3}, "instructions", "string"),
    ({"input": "hi", "stream": "yes"}, "stream", "boolean"),
])
async def test_bad_inputs_name_the_field(template: ChatTemplate, tokenizer: Any, body: dict[str, Any],
                                         param: str, words: str) -> None:
    engine = ScriptedEngine(tokenizer, ["never"])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        error = assert_openai_error(await gw.post(session, body, "v1/responses"), 400, "invalid_request_error")
    assert error["param"] == param and words in error["message"]
    assert engine.prompts == [] and session.forest.nodes == []


async def test_developer_role_is_a_system_message(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["ok"])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        body = {"input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
        reply = await gw.post(session, body, "responses")
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["content"][0]["text"] == "ok"
    assert [m.role for m in session.forest.nodes[1].messages] == ["system", "user"]
