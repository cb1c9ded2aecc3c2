"""The Anthropic Messages front-end over real HTTP: the real `anthropic` SDK against the real gateway.

Only the engine is fake (`ScriptedEngine`; `StopStringEngine` below adds a matched stop string). Covered:
a thinking + tool_use + tool_result conversation replayed into one linear branch, every content block type
of the Messages spec (documents, search results, Claude Code's tool references, server-tool blocks; unknown
or misplaced types are 400s naming the type), `chat_template_kwargs`, Buffered SSE through
`messages.stream`, raw SSE frames and heartbeats, `x-api-key` auth, a Messages turn continued through
Chat Completions, the four stop reasons, `count_tokens`, and bad bodies answered in the Anthropic shape.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from test_gateway import ANSWER, THINK_AND_CALL, generated_ids, kinds, running_gateway

from relax_pipeline.canonical.form import Message, ToolCall
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend, count_tokens, parse_request, signature
from relax_pipeline.testing.engines import FailingEngine, ScriptedEngine, StopStringEngine
from relax_pipeline.turn.sessions import ForestStore, Session, Status

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

PREFIX = "/agentic_api"
SYSTEM = "You are a calculator."
TOOLS = [{"name": "calc", "description": "Add one to x.",
          "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}]
USER = {"role": "user", "content": "x=1, add one"}
REASONING = "The user wants x plus one."


@dataclasses.dataclass
class Gateway:
    """A running gateway serving Chat Completions and Messages, with its store."""

    server: GatewayServer
    store: ForestStore
    http: httpx.AsyncClient

    def open_session(self) -> Session:
        session = self.store.open("group-0", len(self.store), 0, "train", {"messages": []})
        self.store.set_status(session, Status.RUNNING)
        return session

    def client(self, session: Session) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=self.server.base_url.rstrip("/"), api_key=session.key,
                                        max_retries=0, _strict_response_validation=True)

    async def post(self, session: Session | None, body: Any, path: str = "v1/messages") -> httpx.Response:
        headers = {"x-api-key": session.key} if session else {}
        return await self.http.post(self.server.base_url + path, json=body, headers=headers, timeout=30.0)


@asynccontextmanager
async def messages_gateway(template: ChatTemplate, engine: ScriptedEngine, heartbeat_s: float = 15.0
                           ) -> AsyncIterator[Gateway]:
    """The real app serving Chat Completions and Messages, under the real server."""
    frontends = [ChatFrontend(), MessagesFrontend()]
    async with running_gateway(template, engine, heartbeat_s=heartbeat_s, frontends=frontends) as gw:
        yield Gateway(gw.server, gw.store, gw.http)


def assert_linear(session: Session, responses: int) -> None:
    nodes = session.forest.nodes
    assert kinds(session) == ["root"] + ["observation", "response"] * responses
    assert [n.parent for n in nodes] == [None, *range(len(nodes) - 1)] and session.forest.forks == []


def assert_anthropic_error(response: httpx.Response, status: int, kind: str, path: str | None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert path is None or body["error"]["message"].startswith(f"{path}: ")
    return body["error"]["message"]


# --- parsing ------------------------------------------------------------------------------------


async def test_blocks_expand_to_canonical_messages() -> None:
    calls = [{"type": "tool_use", "id": f"t{i}", "name": "calc", "input": {"x": i}} for i in (1, 2)]
    assistant = [{"type": "redacted_thinking", "data": "opaque"}, {"type": "thinking", "thinking": "hm",
                                                                   "signature": "s"},
                 {"type": "text", "text": "Calling."}, *calls]
    results = [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "2"}]},
               {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
               {"type": "text", "text": "and then?", "cache_control": {"type": "ephemeral"}}]
    body = {"max_tokens": 9, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "stop_sequences": ["X"], "tools": [{**TOOLS[0], "type": "custom"}, TOOLS[1]],
            "messages": [USER, {"role": "assistant", "content": assistant}, {"role": "user", "content": results}]}
    request = parse_request(body, RequestMemo())
    assert request.messages == (
        Message("system", "ab"), Message("user", USER["content"]),
        Message("assistant", "Calling.", "hm", (ToolCall("calc", '{"x":1}', "t1"), ToolCall("calc", '{"x":2}', "t2"))),
        Message("tool", "2", tool_call_id="t1"), Message("tool", "Error: boom", tool_call_id="t2"),
        Message("user", "and then?"))
    assert [t["function"]["name"] for t in request.context.tools] == ["calc"]
    assert request.max_tokens == 9 and request.stop == ("X",)
    assert parse_request(body).hashes == request.hashes


DOC = {"type": "document", "title": "Notes", "cache_control": {"type": "ephemeral"},
       "source": {"type": "text", "media_type": "text/plain", "data": "x is 1."}}
SEARCH = {"type": "search_result", "title": "Calc docs", "source": "https://docs.example/calc",
          "content": [{"type": "text", "text": "calc adds one."}], "citations": {"enabled": True}}


async def test_every_spec_block_type_is_read() -> None:
    """Documents, search results, tool references and server-tool blocks are read as text on their own lines;
    thinking is reasoning, redacted thinking is dropped."""
    user = {"role": "user", "content": [
        DOC, {"type": "text", "text": "Add one."}, SEARCH,
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Part."}]}}]}
    assistant = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Search first.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {"query": "calc"}},
        {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": [
            {"type": "web_search_result", "title": "Calc", "url": "https://calc.example", "encrypted_content": "E"}]},
        {"type": "text", "text": "Found it."},
        {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "calc"}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
        {"type": "tool_reference", "tool_name": "calc"}, {"type": "tool_reference", "tool_name": "Bash"},
        {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"}, SEARCH, DOC]}]}
    request = parse_request({"max_tokens": 9, "messages": [user, assistant, result]})
    assert request.messages == (
        Message("user", "Notes\nx is 1.\nAdd one.\nCalc docs\nhttps://docs.example/calc\ncalc adds one.\nPart."),
        Message("assistant", '[server_tool_use web_search] {"query": "calc"}\n[web_search_tool_result] Calc '
                'https://calc.example\nFound it.', "Search first.",
                (ToolCall("ToolSearch", '{"query":"calc"}', "t1"),)),
        Message("tool", "tool_reference: calc\ntool_reference: Bash\n<system-reminder>Be careful.</system-reminder>"
                "\nCalc docs\nhttps://docs.example/calc\ncalc adds one.\nNotes\nx is 1.\n", tool_call_id="t1"))


# --- happy path ---------------------------------------------------------------------------------


async def test_tool_conversation_replays_into_one_branch(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with messages_gateway(template, engine) as gw:
        session = gw.open_session()
        client = gw.client(session)
        extras = {"thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
                  "extra_body": {"temperature": 0.3, "context_management": {"edits": []}, "top_k": 5}}
        first = await client.messages.create(model="claude-x", max_tokens=200, system=SYSTEM, messages=[USER],
                                             tools=TOOLS, **extras)
        assert [b.type for b in first.content] == ["thinking", "tool_use"]
        thinking, call = first.content
        assert thinking.thinking == REASONING and thinking.signature == signature(REASONING)
        assert call.name == "calc" and call.input == {"x": 1}
        assert call.id == session.forest.nodes[2].messages[0].tool_calls[0].id
        assert first.stop_reason == "tool_use" and first.model == "claude-x" and first.id.startswith("msg_")
        assert first.usage.input_tokens == len(engine.prompts[0])
        assert first.usage.output_tokens == len(generated_ids(tokenizer, THINK_AND_CALL))
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "2"}]}
        history = [USER, {"role": "assistant", "content": [b.to_dict() for b in first.content]}, result]
        second = await client.messages.create(model="claude-x", max_tokens=200, system=SYSTEM, messages=history,
                                              tools=TOOLS, **extras)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == ANSWER
    assert second.stop_reason == "end_turn" and second.stop_sequence is None
    assert_linear(session, 2)
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]


async def test_claude_code_blocks_replay_into_one_branch(template: ChatTemplate, tokenizer: Any) -> None:
    """A document and cache_control in the prompt, then a tool_result holding tool_reference blocks and an
    appended system reminder (what Claude Code sends): 200 and one linear branch."""
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with messages_gateway(template, engine) as gw:
        session = gw.open_session()
        client = gw.client(session)
        prompt = {"role": "user", "content": [DOC, {"type": "text", "text": USER["content"],
                                                    "cache_control": {"type": "ephemeral"}}]}
        first = await client.messages.create(model="m", max_tokens=200, messages=[prompt], tools=TOOLS)
        reminder = {"type": "text", "text": "<system-reminder>Stay on task.</system-reminder>"}
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[1].id,
                                               "is_error": False, "content": [
                                                   {"type": "tool_reference", "tool_name": "calc"}, reminder]}]}
        history = [prompt, {"role": "assistant", "content": [b.to_dict() for b in first.content]}, result]
        second = await client.messages.create(model="m", max_tokens=200, messages=history, tools=TOOLS)
    assert second.content[0].text == ANSWER
    assert_linear(session, 2)
    assert session.forest.nodes[1].messages[0].content == "Notes\nx is 1.\n" + USER["content"]
    assert session.forest.nodes[3].messages[0].content == "tool_reference: calc\n" + reminder["text"]


async def test_chat_template_kwargs_reach_the_template(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER])
    kwargs = {"enable_thinking": False}
    async with messages_gateway(template, engine) as gw:
        session = gw.open_session()
        await gw.client(session).messages.create(model="m", max_tokens=20, messages=[USER],
                                                 extra_body={"chat_template_kwargs": kwargs})
    root, observation = session.forest.nodes[:2]
    assert root.context is not None and root.context.template_kwargs == kwargs
    assert engine.prompts[0] == template.prompt_ids(observation.messages, root.context)
    assert engine.prompts[0] != template.prompt_ids(observation.messages, dataclasses.replace(root.context,
                                                                                               template_kwargs=None))


async def test_stream_gives_the_final_message(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL])
    async with messages_gateway(template, engine) as gw:
        session = gw.open_session()
        async with gw.client(session).messages.stream(model="m", max_tokens=200, messages=[USER],
                                                      tools=TOOLS) as stream:
            final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == REASONING and final.content[0].signature == signature(REASONING)
    assert final.content[1].input == {"x": 1} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len(generated_ids(tokenizer, THINK_AND_CALL))
    assert final.usage.input_tokens == len(engine.prompts[0])
    assert_linear(session, 1)


async def test_sse_frames_are_named_events_with_pings(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER], delay_s=0.35)
    async with messages_gateway(template, engine, heartbeat_s=0.1) as gw:
        response = await gw.post(gw.open_session(), {"model": "m", "max_tokens": 50, "messages": [USER],
                                                     "stream": True})
    frames = [f.split("\n") for f in response.text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in frames]
    assert all(lines[0].startswith("event: ") and lines[1].startswith("data: ") for lines in frames)
    assert [json.loads(lines[1].removeprefix("data: "))["type"] for lines in frames] == names
    assert names[0] == "ping" and names.count("ping") >= 3
    assert [n for n in names if n != "ping"] == ["message_start", "content_block_start", "content_block_delta",
                                                 "content_block_stop", "message_delta", "message_stop"]


async def test_stream_error_is_an_error_event(template: ChatTemplate, tokenizer: Any) -> None:
    async with messages_gateway(template, FailingEngine(tokenizer, [ANSWER])) as gw:
        response = await gw.post(gw.open_session(), {"max_tokens": 50, "messages": [USER], "stream": True})
    last = response.text.strip().split("\n\n")[-1].split("\n")
    assert last[0] == "event: error"
    body = json.loads(last[1].removeprefix("data: "))
    assert body["type"] == "error" and body["error"]["type"] == "api_error"


async def test_messages_turn_continued_through_chat(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER])
    async with messages_gateway(template, engine) as gw:
        session = gw.open_session()
        first = await gw.client(session).messages.create(model="m", max_tokens=200, system=SYSTEM,
                                                         messages=[USER], tools=TOOLS)
        call = first.content[1]
        chat = openai.AsyncOpenAI(base_url=gw.server.base_url, api_key=session.key, max_retries=0)
        assistant = {"role": "assistant", "content": None, "reasoning_content": first.content[0].thinking,
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": json.dumps(call.input)}}]}
        tools = [{"type": "function", "function": {"name": "calc", "description": "Add one to x.",
                                                   "parameters": TOOLS[0]["input_schema"]}}]
        second = await chat.chat.completions.create(model="m", tools=tools, messages=[
            {"role": "system", "content": SYSTEM}, USER, assistant,
            {"role": "tool", "tool_call_id": call.id, "content": "2"}])
    assert second.choices[0].message.content == ANSWER
    assert_linear(session, 2)


@pytest.mark.parametrize(("script", "stop", "max_tokens", "reason"), [
    (ANSWER, None, 3, "max_tokens"), (THINK_AND_CALL, None, 200, "tool_use"), (ANSWER, None, 200, "end_turn")])
async def test_stop_reasons(template: ChatTemplate, tokenizer: Any, script: str, stop: list[str] | None,
                            max_tokens: int, reason: str) -> None:
    async with messages_gateway(template, ScriptedEngine(tokenizer, [script])) as gw:
        message = await gw.client(gw.open_session()).messages.create(model="m", max_tokens=max_tokens,
                                                                     messages=[USER], tools=TOOLS)
    assert message.stop_reason == reason and message.stop_sequence is None
    assert message.usage.output_tokens <= max_tokens


async def test_stop_sequence(template: ChatTemplate, tokenizer: Any) -> None:
    async with messages_gateway(template, StopStringEngine(tokenizer, ["one two STOP three"])) as gw:
        message = await gw.client(gw.open_session()).messages.create(model="m", max_tokens=50, messages=[USER],
                                                                     stop_sequences=["STOP"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert message.content[0].text == "one two "


async def test_count_tokens_is_the_first_prompt(template: ChatTemplate, tokenizer: Any) -> None:
    body = {"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": SYSTEM}], "messages": [USER],
            "tools": TOOLS}
    engine = ScriptedEngine(tokenizer, [ANSWER])
    async with messages_gateway(template, engine) as gw:
        response = await gw.post(gw.open_session(), body, "v1/messages?beta=true")
    assert response.status_code == 200, response.text
    del body["max_tokens"]
    assert count_tokens(body, template) == {"input_tokens": len(engine.prompts[0])}


async def test_count_tokens_route_through_the_sdk(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER])
    async with messages_gateway(template, engine) as gw:
        client = gw.client(gw.open_session())
        counted = await client.messages.count_tokens(model="m", messages=[USER], system=SYSTEM, tools=TOOLS)
        await client.messages.create(model="m", max_tokens=20, messages=[USER], system=SYSTEM, tools=TOOLS)
    assert counted.input_tokens == len(engine.prompts[0])


# --- auth and bad requests ----------------------------------------------------------------------


async def test_x_api_key_auth(template: ChatTemplate, tokenizer: Any) -> None:
    async with messages_gateway(template, ScriptedEngine(tokenizer, [ANSWER])) as gw:
        missing = await gw.post(None, {"max_tokens": 5, "messages": [USER]})
        client = anthropic.AsyncAnthropic(base_url=gw.server.base_url.rstrip("/"), api_key="nobody",
                                          max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="m", max_tokens=5, messages=[USER])
    assert_anthropic_error(missing, 401, "authentication_error", None)


@pytest.mark.parametrize(("body", "path"), [
    ({"messages": [USER]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [USER]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
     "messages[0].content[1]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image"}]}]}]},
     "messages[2].content[0].content[0].source"),
    ({"max_tokens": 5, "messages": [USER], "tools": [{"description": "no name"}]}, "tools[0].name"),
    ({"max_tokens": 5, "messages": [USER], "stop_sequences": "STOP"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]}, "messages[0].content[0].source"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_reference"}]}]},
     "messages[0].content[0].tool_name"),
    ({"max_tokens": 5, "messages": [USER], "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),
])
async def test_bad_requests_name_the_field(template: ChatTemplate, tokenizer: Any, body: dict[str, Any],
                                           path: str) -> None:
    async with messages_gateway(template, ScriptedEngine(tokenizer, [ANSWER])) as gw:
        response = await gw.post(gw.open_session(), body)
    message = assert_anthropic_error(response, 400, "invalid_request_error", path)
    assert "text-only" in message or "needs a source" in message or '"image"' not in json.dumps(body)


@pytest.mark.parametrize(("messages", "path", "words"), [
    ([{"role": "user", "content": [{"type": "hologram"}]}], "messages[0].content[0].type",
     "unsupported content block type 'hologram'"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "calc", "input": {}}]}],
     "messages[0].content[0].type", "misplaced content block type 'tool_use'"),
    ([USER, {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "https://a"}}]}],
     "messages[1].content[0].type", "misplaced content block type 'image'"),
    ([USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "thinking", "thinking": "x"}]}]}],
     "messages[2].content[0].content[0].type", "misplaced content block type 'thinking'"),
])
async def test_unknown_or_misplaced_blocks_name_the_type(template: ChatTemplate, tokenizer: Any,
                                                         messages: list[Any], path: str, words: str) -> None:
    async with messages_gateway(template, ScriptedEngine(tokenizer, [ANSWER])) as gw:
        response = await gw.post(gw.open_session(), {"max_tokens": 5, "messages": messages})
    assert words in assert_anthropic_error(response, 400, "invalid_request_error", path)


async def test_sdk_raises_bad_request_with_the_path(template: ChatTemplate, tokenizer: Any) -> None:
    async with messages_gateway(template, ScriptedEngine(tokenizer, [ANSWER])) as gw:
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.role"):
            await gw.client(gw.open_session()).messages.create(
                model="m", max_tokens=5, messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item]
