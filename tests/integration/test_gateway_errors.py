"""Bad requests over real HTTP: each answers its status and the OpenAI error shape, and commits nothing.

The shape is `{"error": {"message", "type", "param", "code"}}` with `param` the field path to fix
(docs/design.md §3.3). Also here: what must be accepted although we do not use it (unknown fields, query
parameters, non-function tools, request temperature/top_p), and the context-length limit.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from test_gateway import Gateway, assert_openai_error, generated_ids, kinds, running_gateway

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(30)]

USER = {"role": "user", "content": "hello"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [CALL]}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(template: ChatTemplate, tokenizer: Any) -> AsyncIterator[Gateway]:
    """One server for the module (a stop costs ~0.2 s); each test opens its own session."""
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"])) as gateway:
        yield gateway


def bad(body: Any, param: str | None, fragment: str, case_id: str) -> Any:
    return pytest.param(body, param, fragment, id=case_id)


BAD_BODIES = [
    bad(b"{not json", None, "not valid JSON", "non-json"),
    bad(b"", None, "not valid JSON", "empty-body"),
    bad(b"\xff\xfe\x00", None, "not valid JSON", "not-utf8"),
    bad([USER], None, "JSON object", "body-is-list"),
    bad("hello", None, "JSON object", "body-is-string"),
    bad(None, None, "JSON object", "body-is-null"),
    bad({"model": "m"}, "messages", "non-empty list", "missing-messages"),
    bad({"messages": []}, "messages", "non-empty list", "empty-messages"),
    bad({"messages": {"role": "user"}}, "messages", "non-empty list", "messages-not-list"),
    bad({"messages": ["hello"]}, "messages[0]", "object", "message-not-object"),
    bad({"messages": [{"role": "robot", "content": "beep"}]}, "messages[0].role", "robot", "unknown-role"),
    bad({"messages": [{"content": "no role"}]}, "messages[0].role", "role", "missing-role"),
    bad({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "non-empty", "empty-user"),
    bad({"messages": [{"role": "user"}]}, "messages[0].content", "non-empty", "missing-user-content"),
    bad({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content",
        "non-empty", "empty-user-parts"),
    bad({"messages": [{"role": "system", "content": ""}, USER]}, "messages[0].content", "non-empty",
        "empty-system"),
    bad({"messages": [USER, {"role": "assistant", "content": None}, USER]}, "messages[1].content",
        "tool_calls", "empty-assistant"),
    bad({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "string", "content-number"),
    bad({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}]},
        "messages[0].content[1]", "text-only", "image-part"),
    bad({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]",
        "audio", "unknown-part"),
    bad({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, USER]},
        "messages[1].tool_calls[0].function.name", "name", "tool-call-without-name"),
    bad({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": 3}}]}, USER]},
        "messages[1].tool_calls[0].function.arguments", "arguments", "tool-call-arguments-number"),
    bad({"messages": [USER, {"role": "assistant", "content": "prefill"}]}, "messages[1].role", "assistant",
        "assistant-last"),
    bad({"messages": [USER], "tools": {"name": "calc"}}, "tools", "list", "tools-not-list"),
    bad({"messages": [USER], "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name",
        "name", "tool-without-name"),
    bad({"messages": [USER], "chat_template_kwargs": "thinking"}, "chat_template_kwargs", "object",
        "kwargs-not-object"),
    *[bad({"messages": [USER], "chat_template_kwargs": {key: True}}, f"chat_template_kwargs.{key}", key,
          f"kwargs-{key}") for key in ("add_generation_prompt", "tokenize", "tools")],
    *[bad({"messages": [USER], key: value}, key, "positive integer", f"{key}={value!r}")
      for key in ("max_tokens", "max_completion_tokens") for value in (0, -3, "16", 1.5, True)],
    bad({"messages": [USER], "stop": 3}, "stop", "string", "stop-number"),
    bad({"messages": [USER], "seed": "7"}, "seed", "integer", "seed-string"),
]


@pytest.mark.parametrize("body, param, fragment", BAD_BODIES)
async def test_bad_request_answers_400_with_field_path(gw: Gateway, body: Any, param: str | None,
                                                       fragment: str) -> None:
    session, calls = gw.open_session(), len(gw.engine.prompts)
    error = assert_openai_error(await gw.post(session, body), 400, "invalid_request_error")
    assert error["param"] == param
    assert fragment.lower() in error["message"].lower()
    assert error["code"] is None
    assert len(gw.engine.prompts) == calls and session.forest.nodes == [] and session.forest.forks == []


async def test_deeply_nested_body_is_a_bad_request(gw: Gateway) -> None:
    session = gw.open_session()
    error = assert_openai_error(await gw.post(session, b"[" * 100_000), 400, "invalid_request_error")
    assert error["param"] is None


async def test_bad_request_after_a_turn_keeps_the_forest(gw: Gateway) -> None:
    session, calls = gw.open_session(), len(gw.engine.prompts)
    assert (await gw.post(session, {"messages": [USER]})).status_code == 200
    history = [USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": ""}]
    error = assert_openai_error(await gw.post(session, {"messages": history}), 400, "invalid_request_error")
    assert error["param"] == "messages[2].content"
    assert kinds(session) == ["root", "observation", "response"] and len(gw.engine.prompts) == calls + 1


# --- accepted although unused -------------------------------------------------------------------

EXTRAS = {
    "temperature": 0.1, "top_p": 0.2, "foo": {"bar": [1, 2]}, "tool_choice": "required",
    "parallel_tool_calls": False, "response_format": {"type": "json_object"},
    "stream_options": {"include_usage": True}, "stream": False, "n": 1, "user": "u-1", "store": False,
    "metadata": {"trace": "x"}, "reasoning_effort": "high", "prompt_cache_key": "k", "top_logprobs": 3,
    "tools": [{"type": "web_search"}, {"type": "function", "function": {"name": "calc"}}],
}


async def test_unknown_fields_and_query_parameters_are_accepted(template: ChatTemplate, tokenizer: Any) -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.9)
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"]), defaults) as gw:
        session = gw.open_session()
        response = await gw.post(session, {"model": "m", "messages": [USER], **EXTRAS},
                                 path="v1/chat/completions?beta=true&api-version=2024-10-01")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "hi"
    root, observation, reply = session.forest.nodes
    assert [t["function"]["name"] for t in root.context.tools] == ["calc"]  # only function tools reach the model
    assert (reply.sampling.temperature, reply.sampling.top_p) == (0.7, 0.9)  # the training config rules


# --- context length -----------------------------------------------------------------------------

LONG = "please tell me a very long story about numbers and tools and many other things " * 3


def assert_context_error(error: dict[str, Any], prompt_len: int, limit: int) -> None:
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert [int(n) for n in re.findall(r"\d+", error["message"])] == [prompt_len, limit]


@pytest.mark.parametrize("spare", [-5, 0])
async def test_first_turn_context_overflow(template: ChatTemplate, tokenizer: Any, spare: int) -> None:
    prompt_len = len(template.prompt_ids((Message("user", LONG),), Context()))
    limit = prompt_len + spare
    engine = ScriptedEngine(tokenizer, ["hi"])
    async with running_gateway(template, engine, SamplingDefaults(max_context_len=limit)) as gw:
        session = gw.open_session()
        response = await gw.post(session, {"messages": [{"role": "user", "content": LONG}]})
        assert_context_error(assert_openai_error(response, 400, "invalid_request_error"), prompt_len, limit)
    assert engine.prompts == [] and session.forest.nodes == []


async def test_one_token_of_room_generates_one_token(template: ChatTemplate, tokenizer: Any) -> None:
    limit = len(template.prompt_ids((Message("user", LONG),), Context())) + 1
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi there"]),
                               SamplingDefaults(max_context_len=limit)) as gw:
        session = gw.open_session()
        response = await gw.post(session, {"messages": [{"role": "user", "content": LONG}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 1


async def test_later_turn_context_overflow_counts_the_whole_lineage(template: ChatTemplate, tokenizer: Any) -> None:
    first_len = len(template.prompt_ids((Message("user", "hello"),), Context()))
    generated = len(generated_ids(tokenizer, "hi"))
    delta = len(template.delta_ids((Message("user", LONG),), Context(), True))
    limit = first_len + generated + delta - 1
    engine = ScriptedEngine(tokenizer, ["hi"])
    async with running_gateway(template, engine, SamplingDefaults(max_context_len=limit)) as gw:
        session = gw.open_session()
        assert (await gw.post(session, {"messages": [USER]})).status_code == 200
        history = [USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": LONG}]
        response = await gw.post(session, {"messages": history})
        assert_context_error(assert_openai_error(response, 400, "invalid_request_error"),
                             first_len + generated + delta, limit)
    assert kinds(session) == ["root", "observation", "response"] and len(engine.prompts) == 1


async def test_stream_must_be_a_boolean(gw: Gateway) -> None:
    session = gw.open_session()
    error = assert_openai_error(await gw.post(session, {"messages": [USER], "stream": "false"}), 400,
                                "invalid_request_error")
    assert error["param"] == "stream" and "boolean" in error["message"]


async def test_unknown_route_and_wrong_method_answer_in_openai_shape(gw: Gateway) -> None:
    session = gw.open_session()
    async with httpx.AsyncClient(base_url=gw.base_url, headers={"Authorization": f"Bearer {session.key}"}) as raw:
        missing = await raw.post("v1/responses", json={"input": "hi"})
        wrong = await raw.get("v1/chat/completions")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert "chat/completions" in missing.json()["error"]["message"]
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


async def test_session_not_started_yet_is_not_found(gw: Gateway) -> None:
    session = gw.store.open("group-x", 0, 0, "train", {})
    error = assert_openai_error(await gw.post(session, {"messages": [USER]}), 404, "not_found_error")
    assert "not started" in error["message"]
