"""The Responses front-end over real HTTP: the real `openai` SDK (strict response validation) against the
real gateway serving Chat Completions and Responses side by side; only the engine is scripted.

Covered: a tool conversation replayed in full (reasoning + function_call + function_call_output items)
that lands on one linear branch, the same conversation continued through Chat Completions on the same
lineage, or by `previous_response_id` with only the new items, Buffered SSE in the spec's full event
sequence (through `responses.create(stream=True)`, the `responses.stream()` helper and raw frames checked
against the SDK's event types; heartbeats, failure), the `incomplete` status on the token limit,
`chat_template_kwargs`, and bad inputs answering 400 with the field path.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from test_gateway import (
    ANSWER,
    FOLLOW_UP,
    THINK_AND_CALL,
    TOOLS,
    Gateway,
    assert_openai_error,
    generated_ids,
    kinds,
    running_gateway,
)

from relax_pipeline.canonical.form import Context
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import FailingEngine, ScriptedEngine
from relax_pipeline.turn.sessions import Session

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}, {"type": "web_search"}]
SYSTEM = "You add numbers."
USER = {"role": "user", "content": "What is 1 plus one?"}
REASONING = "The user wants x plus one."
TEXT_AND_CALL = THINK_AND_CALL.replace("</think>\n\n", "</think>\n\nLet me add.\n")
OPEN = ["response.created", "response.in_progress"]
REASONING_EVENTS = ["response.output_item.added", "response.reasoning_summary_part.added",
                    "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
                    "response.reasoning_summary_part.done", "response.output_item.done"]
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]
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
    return openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0,
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


# --- previous_response_id ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_previous_response_id_continues_the_stored_lineage(template: ChatTemplate, tokenizer: Any,
                                                                 stream: bool) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        if stream:
            first = (await sdk_events(gw, session, instructions=SYSTEM, input=[USER], tools=FLAT_TOOLS))[-1].response
        else:
            async with strict_sdk(gw, session) as client:
                first = await client.responses.create(model="m", instructions=SYSTEM, input=[USER], tools=FLAT_TOOLS)
        output = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "2"}
        async with strict_sdk(gw, session) as client:
            second = await client.responses.create(model="m", instructions=SYSTEM, previous_response_id=first.id,
                                                   input=[output], tools=FLAT_TOOLS)
    assert second.output_text == ANSWER
    assert_one_branch(session, 2)
    gen0 = generated_ids(tokenizer, THINK_AND_CALL)
    assert engine.prompts[1][: len(engine.prompts[0]) + len(gen0)] == engine.prompts[0] + gen0
    assert session.forest.nodes[3].messages[0].tool_call_id == first.output[1].call_id


async def test_previous_response_id_and_new_instructions(template: ChatTemplate, tokenizer: Any) -> None:
    """Without `instructions` the stored system message stays; new ones take its place (a new branch)."""
    engine = ScriptedEngine(tokenizer, [ANSWER, FOLLOW_UP, FOLLOW_UP])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client:
            first = await client.responses.create(model="m", instructions=SYSTEM, input="hi")
            kept = await client.responses.create(model="m", previous_response_id=first.id, input="thanks")
            await client.responses.create(model="m", instructions="Be terse.", previous_response_id=kept.id,
                                          input="bye")
    nodes = session.forest.nodes
    assert nodes[3].parent == 2 and [m.content for m in nodes[3].messages] == ["thanks"]
    assert nodes[5].parent == 0 and [m.content for m in nodes[5].messages] == ["Be terse.", "hi", ANSWER, "thanks",
                                                                               FOLLOW_UP, "bye"]
    assert [f.message_index for f in session.forest.forks] == [0]


async def test_previous_response_id_of_another_session_is_unknown(template: ChatTemplate, tokenizer: Any
                                                                  ) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER])
    async with responses_gateway(template, engine) as gw:
        owner, other = gw.open_session(), gw.open_session()
        async with strict_sdk(gw, owner) as client:
            first = await client.responses.create(model="m", input="hi")
        reply = await gw.post(other, {"input": "more", "previous_response_id": first.id}, "v1/responses")
    error = assert_openai_error(reply, 400, "invalid_request_error")
    assert error["param"] == "previous_response_id" and first.id in error["message"]
    assert other.forest.nodes == []


# --- chat_template_kwargs -----------------------------------------------------------------------


async def test_chat_template_kwargs_reach_the_template(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER, ANSWER])
    kwargs = {"enable_thinking": False}
    async with responses_gateway(template, engine) as gw:
        via_responses, via_chat = gw.open_session(), gw.open_session()
        async with strict_sdk(gw, via_responses) as client:
            await client.responses.create(model="m", input="hi", extra_body={"chat_template_kwargs": kwargs})
        async with strict_sdk(gw, via_chat) as client:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 extra_body={"chat_template_kwargs": kwargs})
    assert via_responses.forest.nodes[0].context.template_kwargs == kwargs
    assert engine.prompts[0] == engine.prompts[1]
    assert engine.prompts[0] != template.prompt_ids(via_responses.forest.nodes[1].messages, Context())


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
    assert [e.type for e in events] == [*OPEN, *MESSAGE_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    final = events[-1].response
    assert final.status == "completed" and final.output_text == ANSWER
    added, part, delta, text, part_done, done = events[2:8]
    assert added.item.content == [] and added.item.status == "in_progress" and added.item.id == final.output[0].id
    assert part.part.text == "" and part.content_index == 0 and part.item_id == final.output[0].id
    assert delta.delta == ANSWER and text.text == ANSWER and part_done.part == final.output[0].content[0]
    assert done.item == final.output[0] and done.output_index == 0
    assert final.usage.output_tokens == len(generated_ids(tokenizer, ANSWER))
    assert session.forest.turn_count == 1


async def test_stream_with_tools(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [TEXT_AND_CALL])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        events = await sdk_events(gw, session, input=[USER], tools=FLAT_TOOLS)
    assert [e.type for e in events] == [*OPEN, *REASONING_EVENTS, *MESSAGE_EVENTS, *CALL_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message"), (2, "function_call")]
    final = events[-1].response
    assert final.output == [e.item for e in done]
    summary = {e.type: e for e in events if e.type.startswith("response.reasoning_summary")}
    assert summary["response.reasoning_summary_text.delta"].delta == REASONING
    assert summary["response.reasoning_summary_part.done"].part.text == REASONING
    arguments = {e.type: e for e in events if e.type.startswith("response.function_call_arguments")}
    assert arguments["response.function_call_arguments.delta"].delta == final.output[2].arguments
    assert arguments["response.function_call_arguments.done"].item_id == final.output[2].id
    assert final.output[2].call_id == session.forest.nodes[2].messages[0].tool_calls[0].id


async def test_stream_helper_gets_text_deltas_and_the_final_response(template: ChatTemplate, tokenizer: Any
                                                                    ) -> None:
    """The SDK's `responses.stream()` accumulates the deltas (what LangChain's streaming reads)."""
    engine = ScriptedEngine(tokenizer, [TEXT_AND_CALL])
    async with responses_gateway(template, engine) as gw:
        session = gw.open_session()
        async with strict_sdk(gw, session) as client, client.responses.stream(
                model="m", input=[USER], tools=FLAT_TOOLS) as stream:
            deltas = [e async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
    assert [d.delta for d in deltas] == ["Let me add."] and deltas[-1].snapshot == "Let me add."
    assert final.output_text == "Let me add." and [i.type for i in final.output] == ["reasoning", "message",
                                                                                       "function_call"]
    assert json.loads(final.output[2].arguments) == {"x": 1} and final.status == "completed"


async def test_raw_frames_are_the_sdk_event_types(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [TEXT_AND_CALL])
    async with responses_gateway(template, engine) as gw:
        text = await gw.post_stream(gw.open_session(), {"input": [USER], "tools": FLAT_TOOLS, "stream": True},
                                    "v1/responses")
    frames = [f.split("\n", 1) for f in text.strip().split("\n\n")]
    events = [json.loads(data.removeprefix("data: ")) for _, data in frames]
    assert [name.removeprefix("event: ") for name, _ in frames] == [e["type"] for e in events]
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_python(e).type for e in events] == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


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
    assert [e.type for e in events] == [*OPEN, *MESSAGE_EVENTS, "response.incomplete"]
    assert events[-1].response.status == "incomplete" and events[-2].item.status == "incomplete"
    assert events[4].delta == reply.output[0].content[0].text
    assert session.forest.nodes[2].sampling.max_new_tokens == 2


# --- bad inputs ---------------------------------------------------------------------------------

IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "not a response of this session"),
    ({"input": "hi", "previous_response_id": 3}, "previous_response_id", "not a response of this session"),
    ({"input": "hi", "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "set by the gateway"),
    ({"input": "hi", "chat_template_kwargs": "x"}, "chat_template_kwargs", "object"),
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
