"""What real harnesses send, answered in each protocol's own shape (issue: real harnesses run unchanged).

Each test replays a request shape that a real harness was seen sending (shared/HARNESSES.md) through the
real SDK against a real gateway; only the engine is scripted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import pytest_asyncio
from test_gateway import TOOLS, Gateway, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.tracking.logs import ACCESS_LOGGER
from relax_pipeline.turn.records import SamplingDefaults
from relax_pipeline.turn.sessions import Session

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(30)]

CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(template: ChatTemplate, tokenizer: Any) -> AsyncIterator[Gateway]:
    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    async with running_gateway(template, ScriptedEngine(tokenizer, [CALL, "Done."]), frontends=frontends) as gateway:
        yield gateway


def claude(gw: Gateway, session: Session) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.base_url.rstrip("/"), api_key=session.key, max_retries=0)


# ---- 1. a tool that printed nothing ------------------------------------------------------------------------

async def test_chat_accepts_an_empty_tool_output(gw: Gateway) -> None:
    session = gw.open_session()
    client = gw.sdk(session)
    messages: list[Any] = [{"role": "user", "content": "Add one to 1."}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": ""}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "Done."
    assert session.forest.turn_count == 2 and len(session.forest.leaves()) == 1


async def test_responses_accepts_an_empty_function_call_output(gw: Gateway) -> None:
    session = gw.open_session()
    client = gw.sdk(session)
    tools = [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]
    first = await client.responses.create(model="m", input="Add one to 1.", tools=tools)
    call = next(item for item in first.output if item.type == "function_call")
    items: list[Any] = [{"role": "user", "content": "Add one to 1."},
                        *[item.model_dump(exclude_none=True) for item in first.output],
                        {"type": "function_call_output", "call_id": call.call_id, "output": ""}]
    second = await client.responses.create(model="m", input=items, tools=tools)
    assert second.output_text == "Done."
    assert session.forest.turn_count == 2


@pytest.mark.parametrize("empty", ["", []], ids=["string", "list"])
async def test_messages_accepts_an_empty_tool_result(gw: Gateway, empty: Any) -> None:
    session = gw.open_session()
    client = claude(gw, session)
    tools = [{"name": "calc", "input_schema": {"type": "object"}}]
    messages: list[Any] = [{"role": "user", "content": "Add one to 1."}]
    first = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=tools)
    use = next(block for block in first.content if block.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": empty}]}]
    second = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=tools)
    assert second.content[0].text == "Done."
    assert session.forest.turn_count == 2


# ---- 8. smaller ---------------------------------------------------------------------------------------------

async def test_developer_role_is_a_system_message(gw: Gateway) -> None:
    session = gw.open_session()
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    await gw.sdk(session).chat.completions.create(model="m", messages=messages)
    root_messages = session.forest.nodes[1].messages
    assert [m.role for m in root_messages] == ["system", "user"]


# ---- 6. over the context limit: a 400 in the provider's shape, before any stream opens ---------------------

LONG = "word " * 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_context_limit_is_a_400_before_the_stream_opens(template: ChatTemplate, tokenizer: Any,
                                                             stream: bool) -> None:
    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"]), SamplingDefaults(max_context_len=64),
                               frontends=frontends) as small:
        session = small.open_session()
        chat = await small.post(session, {"messages": [{"role": "user", "content": LONG}], "stream": stream})
        responses = await small.post(session, {"input": LONG, "stream": stream}, "v1/responses")
        messages = await small.post(session, {"max_tokens": 8, "stream": stream,
                                              "messages": [{"role": "user", "content": LONG}]}, "v1/messages")
    for reply in (chat, responses):
        assert reply.status_code == 400 and reply.headers["content-type"].startswith("application/json")
        assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert messages.status_code == 400
    assert messages.json()["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in messages.json()["error"]["message"]


# ---- 7. every request has an access line; errors are warnings ---------------------------------------------

async def test_every_request_writes_one_access_line(gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    session = gw.open_session()
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    await gw.sdk(session).chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    await gw.post(session, {"messages": []})
    await gw.post(session, {"messages": [{"role": "user", "content": "Hi"}], "stream": True})
    await gw.post(session, {"messages": [], "stream": True})
    lines = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [r.levelname for r in lines] == ["INFO", "WARNING", "INFO", "WARNING"]
    assert "status=400 stream=true" in lines[3].getMessage(), "a refused stream request is logged as one"
    lines = lines[:3]
    assert all(f"session={session.id}" in r.getMessage() for r in lines)
    ok, refused, streamed = (r.getMessage() for r in lines)
    assert "status=200" in ok and "completion_tokens=" in ok
    assert "status=400" in refused and "messages: messages must be a non-empty list" in refused
    assert "stream=true" in streamed


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def turns(template: ChatTemplate, tokenizer: Any) -> AsyncIterator[Gateway]:
    """A gateway whose engine answers by the prompt, not by call order: the tool call first, "Done." once a
    tool result is in the prompt."""
    def answer(prompt_ids: Any) -> str:
        return "Done." if "<tool_response>" in tokenizer.decode(prompt_ids) else CALL

    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    async with running_gateway(template, ScriptedEngine(tokenizer, answer), frontends=frontends) as gateway:
        yield gateway


# ---- streamed Responses carry their text (LangChain ChatOpenAI(use_responses_api=True, streaming)) ----------

async def test_streamed_responses_carry_text_and_argument_deltas(turns: Gateway) -> None:
    session = turns.open_session()
    client = turns.sdk(session)
    tools = [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]
    events = [e async for e in await client.responses.create(model="m", input="Add one to 1.", tools=tools,
                                                              stream=True)]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = next(item for item in events[-1].response.output if item.type == "function_call")
    assert arguments == call.arguments and events[-1].type == "response.completed"
    items: list[Any] = [{"role": "user", "content": "Add one to 1."},
                        *[item.model_dump(exclude_none=True) for item in events[-1].response.output],
                        {"type": "function_call_output", "call_id": call.call_id, "output": "2"}]
    async with client.responses.stream(model="m", input=items, tools=tools) as stream:
        text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        final = await stream.get_final_response()
    assert text == final.output_text == "Done."
    assert session.forest.turn_count == 2 and len(session.forest.leaves()) == 1


# ---- Claude Code's tool_reference blocks inside a tool_result (always streaming, ?beta=true) ----------------

async def test_claude_code_tool_reference_in_a_tool_result(turns: Gateway) -> None:
    session = turns.open_session()
    client = claude(turns, session)
    tools = [{"name": "calc", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Add one to 1."}]}]
    betas = ["claude-code-20250219", "interleaved-thinking-2025-05-14"]
    async with client.beta.messages.stream(model="m", max_tokens=64, messages=messages, tools=tools,
                                           betas=betas) as stream:
        first = await stream.get_final_message()
    use = next(block for block in first.content if block.type == "tool_use")
    found = [{"type": "tool_reference", "tool_name": "calc"},
             {"type": "text", "text": "<system-reminder>Use the tool.</system-reminder>"}]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": found}]}]
    async with client.beta.messages.stream(model="m", max_tokens=64, messages=messages, tools=tools,
                                           betas=betas) as stream:
        second = await stream.get_final_message()
    assert second.content[0].text == "Done."
    assert session.forest.turn_count == 2 and session.forest.forks == []
    assert session.forest.nodes[3].messages[0].content.startswith("tool_reference: calc\n")


# ---- previous_response_id: only the new items are sent (openai-agents with server-side conversation state) -

async def test_previous_response_id_sends_only_the_new_items(turns: Gateway) -> None:
    session = turns.open_session()
    client = turns.sdk(session)
    tools = [{"type": "function", "name": "calc", "parameters": {"type": "object"}}]
    first = await client.responses.create(model="m", instructions="Be brief.", input="Add one to 1.", tools=tools)
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "2"}
    second = await client.responses.create(model="m", instructions="Be brief.", previous_response_id=first.id,
                                           input=[output], tools=tools)
    assert second.output_text == "Done."
    assert session.forest.turn_count == 2 and len(session.forest.leaves()) == 1 and session.forest.forks == []
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="m", previous_response_id="resp_unknown", input="again")
    assert refused.value.body["param"] == "previous_response_id"


# ---- Claude Code: a system message inside `messages` -----------------------------------------------------

async def test_messages_accepts_a_system_message_mid_conversation(gw: Gateway) -> None:
    session = gw.open_session()
    environment = {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /tmp"}]}
    body = {"model": "m", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}, environment]}
    reply = await gw.post(session, body, "v1/messages?beta=true")
    assert reply.status_code == 200 and "message_stop" in reply.text
    roles = [m.role for m in session.forest.nodes[1].messages]
    assert roles == ["user", "system"]


async def test_a_base_url_ending_in_a_slash_still_routes(gw: Gateway) -> None:
    session = gw.open_session()
    reply = await gw.post(session, {"messages": [{"role": "user", "content": "Hi"}]}, "/chat/completions")
    assert gw.base_url.endswith("/") and reply.status_code == 200, reply.text


async def test_n_other_than_one_is_refused_naming_n(gw: Gateway) -> None:
    session = gw.open_session()
    reply = await gw.post(session, {"messages": [{"role": "user", "content": "Hi"}], "n": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"
    assert "n=2 is not supported" in reply.json()["error"]["message"]
