"""The gateway over real HTTP: uvicorn on 127.0.0.1:0, the real `openai` SDK and `httpx`, real forest.

Only the engine is fake (`ScriptedEngine`: scripted texts through the real tokenizer), so every
expected token id is known. Covered here: the happy path (tool call, reasoning, logprobs, usage,
token-in/token-out prompts, both URL forms, models, health), canonical tool-call arguments, auth and
session isolation, and aborted or failed generations that commit nothing. Bad request bodies live in
`test_gateway_errors.py`, which reuses `running_gateway` and `Gateway` from this module.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.gateway.app import create_app
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.testing.engines import AbortingEngine, FailingEngine, ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore, Session, Status

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

PREFIX = "/agentic_api"
ERROR_FIELDS = {"message", "type", "param", "code"}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Add one to x.",
                                            "parameters": {"type": "object",
                                                           "properties": {"x": {"type": "integer"}}}}}]
THINK_AND_CALL = ('<think>\nThe user wants x plus one.\n</think>\n\n'
                  '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>')
ANSWER = "The result is 2."
FOLLOW_UP = "You are welcome."


@dataclass
class Gateway:
    """A running gateway with its store and engine, for one test."""

    server: GatewayServer
    store: ForestStore
    engine: ScriptedEngine
    http: httpx.AsyncClient
    """One raw client per gateway (building an httpx client loads TLS certificates: ~0.1 s)."""

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def root_url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def open_session(self) -> Session:
        session = self.store.open("group-0", len(self.store), 0, "train", {"messages": []})
        self.store.set_status(session, Status.RUNNING)
        return session

    def sdk(self, session: Session) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=session.key, max_retries=0)

    async def post(self, session: Session | None, body: Any, path: str = "v1/chat/completions",
                   headers: dict[str, str] | None = None, timeout: float | None = None) -> httpx.Response:
        """POST a raw body (bytes are sent as they are, anything else as JSON)."""
        auth = {"Authorization": f"Bearer {session.key}"} if session is not None else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.http.post(self.base_url + path, content=content, timeout=timeout or 30.0,
                                    headers={"content-type": "application/json", **auth, **(headers or {})})

    async def post_stream(self, session: Session, body: Any, path: str = "v1/chat/completions") -> str:
        """POST and read the whole SSE body as text."""
        response = await self.post(session, body, path)
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.text


@asynccontextmanager
async def running_gateway(template: ChatTemplate, engine: ScriptedEngine,
                          defaults: SamplingDefaults | None = None, heartbeat_s: float = 15.0,
                          frontends: list | None = None) -> AsyncIterator[Gateway]:
    """The real app under the real server, in the test's event loop (Chat only unless `frontends`)."""
    store = ForestStore()
    turns = TurnService(template, engine, OutputParser(), defaults or SamplingDefaults())
    app = create_app(store, turns, prefix=PREFIX, heartbeat_s=heartbeat_s, frontends=frontends)
    server = GatewayServer(app, prefix=PREFIX)
    await server.start()
    try:
        async with httpx.AsyncClient() as http:
            yield Gateway(server, store, engine, http)
    finally:
        await server.stop()


def generated_ids(tokenizer: Any, text: str) -> list[int]:
    """What ScriptedEngine generates for `text`: its tokens and the end-of-turn token."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def kinds(session: Session) -> list[str]:
    return [node.kind for node in session.forest.nodes]


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


# --- happy path ---------------------------------------------------------------------------------


async def test_three_turn_tool_conversation(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL, ANSWER, FOLLOW_UP])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        history: list[dict[str, Any]] = [{"role": "system", "content": "You add numbers."},
                                         {"role": "user", "content": "What is 1 plus one?"}]
        async with gw.sdk(session) as client:
            first = await client.chat.completions.create(model="policy-under-test", messages=history,
                                                         tools=TOOLS, logprobs=True)
            gen0 = generated_ids(tokenizer, THINK_AND_CALL)
            choice = first.choices[0]
            assert first.model == "policy-under-test"
            assert choice.finish_reason == "tool_calls"
            assert choice.message.reasoning_content == "The user wants x plus one."
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "calc" and call.id
            assert json.loads(call.function.arguments) == {"x": 1}
            assert first.usage.prompt_tokens == len(engine.prompts[0])
            assert first.usage.completion_tokens == len(gen0)
            assert first.usage.total_tokens == len(engine.prompts[0]) + len(gen0)
            entries = choice.logprobs.content
            assert len(entries) == len(gen0) and all(e.logprob == -0.5 for e in entries)
            assert "".join(e.token for e in entries) == tokenizer.decode(gen0, skip_special_tokens=False)

            history += [choice.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": "2"}]
            second = await client.chat.completions.create(model="policy-under-test", messages=history,
                                                          tools=TOOLS)
            gen1 = generated_ids(tokenizer, ANSWER)
            assert second.choices[0].finish_reason == "stop"
            assert second.choices[0].message.content == ANSWER
            assert getattr(second.choices[0].message, "reasoning_content", None) is None
            assert second.choices[0].logprobs is None
            assert second.usage.prompt_tokens == len(engine.prompts[1]) > first.usage.prompt_tokens
            assert engine.prompts[1][: len(engine.prompts[0]) + len(gen0)] == engine.prompts[0] + gen0

        history += [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks!"}]
        third = await gw.post(session, {"model": "policy-under-test", "messages": history, "tools": TOOLS})
        assert third.status_code == 200, third.text
        body = third.json()
        assert body["model"] == "policy-under-test" and body["object"] == "chat.completion"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": FOLLOW_UP}
        assert body["usage"]["prompt_tokens"] == len(engine.prompts[2]) > second.usage.prompt_tokens
        assert engine.prompts[2][: len(engine.prompts[1]) + len(gen1)] == engine.prompts[1] + gen1

    nodes = session.forest.nodes
    assert kinds(session) == ["root", "observation", "response", "observation", "response", "observation",
                              "response"]
    assert [n.parent for n in nodes] == [None, 0, 1, 2, 3, 4, 5] and session.forest.forks == []
    lineage = tokenizer.decode(session.forest.prompt_ids(nodes[-1]), skip_special_tokens=False)
    final = history + [{"role": "assistant", "content": FOLLOW_UP}]
    assert lineage + "\n" == full_render(tokenizer, final)  # the render ends with the glue "\n"


def full_render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat template's one-shot rendering (tool-call arguments as mappings, as HF templates expect)."""
    def plain(message: dict[str, Any]) -> dict[str, Any]:
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in message.get("tool_calls", [])]
        return {**message, "tool_calls": calls} if calls else message

    return tokenizer.apply_chat_template([plain(m) for m in messages], tools=TOOLS, tokenize=False)


async def test_models_health_and_both_url_forms(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["Hi there."])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        async with gw.sdk(session) as client:
            listed = await client.models.list()
            assert [m.id for m in listed.data] == ["relax"]
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "Hi there."
        auth = {"Authorization": f"Bearer {session.key}"}
        for path in ("models", "v1/models", "v1/models?beta=true"):
            listed_raw = await gw.http.get(gw.base_url + path, headers=auth)
            assert listed_raw.status_code == 200
            assert listed_raw.json()["object"] == "list"
            assert [m["id"] for m in listed_raw.json()["data"]] == ["relax"]
        health = await gw.http.get(gw.root_url + "/health")
        assert health.status_code == 200 and health.json() == {"status": "ok", "weight_version": 0}
        assert gw.base_url.endswith(PREFIX + "/")
        bare = await gw.post(session, {"messages": [{"role": "user", "content": "hi"}]}, path="chat/completions")
        assert bare.status_code == 200 and bare.json()["model"] == "relax"
    assert session.forest.turn_count == 2


async def test_max_tokens_limits_generation(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["a long answer that will not fit"])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        async with gw.sdk(session) as client:
            reply = await client.chat.completions.create(  # the newer field wins over the legacy one
                model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, max_tokens=50
            )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 2
    assert session.forest.nodes[-1].sampling.max_new_tokens == 2


# --- canonical history --------------------------------------------------------------------------

CALL_AB = '<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
PYTHON_ARGS = json.dumps({"a": 1, "b": "x"})  # '{"a": 1, "b": "x"}'
JAVASCRIPT_ARGS = '{"b":"x","a":1}'  # JSON.stringify of an object built in another order


@pytest.mark.parametrize("first_form, second_form", [(PYTHON_ARGS, JAVASCRIPT_ARGS), (JAVASCRIPT_ARGS, PYTHON_ARGS)])
async def test_tool_call_argument_serialisation_matches_one_state(
    template: ChatTemplate, tokenizer: Any, first_form: str, second_form: str
) -> None:
    engine = ScriptedEngine(tokenizer, [CALL_AB, "done", "done again"])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        user = {"role": "user", "content": "Call calc."}
        first = await gw.post(session, {"messages": [user], "tools": TOOLS})
        call_id = first.json()["choices"][0]["message"]["tool_calls"][0]["id"]

        def history(arguments: str) -> list[dict[str, Any]]:
            call = {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": arguments}}
            return [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call_id, "content": "ok"}]

        assert (await gw.post(session, {"messages": history(first_form), "tools": TOOLS})).status_code == 200
        assert len(session.forest.nodes) == 5
        assert (await gw.post(session, {"messages": history(second_form), "tools": TOOLS})).status_code == 200
    nodes = session.forest.nodes
    assert kinds(session) == ["root", "observation", "response", "observation", "response", "response"]
    assert nodes[5].parent == nodes[3].id  # the same committed observation, no new branch
    assert session.forest.forks == []
    assert engine.prompts[2] == engine.prompts[1]


# --- auth and isolation -------------------------------------------------------------------------

HELLO = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def test_credentials(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["hi"])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        missing = assert_openai_error(await gw.post(None, HELLO), 401, "authentication_error")
        assert "Bearer" in missing["message"]
        assert_openai_error(await gw.post(None, HELLO, headers={"Authorization": "Bearer sess-nope"}),
                            401, "authentication_error")
        assert_openai_error(await gw.post(None, b"not json", headers={"Authorization": "Bearer sess-nope"}),
                            401, "authentication_error")
        assert_openai_error(await gw.http.get(gw.base_url + "v1/models"), 401, "authentication_error")
        assert engine.prompts == [] and session.forest.nodes == []
        by_key = await gw.post(None, HELLO, headers={"x-api-key": session.key})
        assert by_key.status_code == 200, by_key.text
        assert kinds(session) == ["root", "observation", "response"]


async def test_finished_session_answers_404(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["hi"])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        assert (await gw.post(session, HELLO)).status_code == 200
        gw.store.set_status(session, Status.COMPLETED)
        error = assert_openai_error(await gw.post(session, HELLO), 404, "not_found_error")
        assert session.id in error["message"] and "completed" in error["message"]
        models = await gw.http.get(gw.base_url + "models", headers={"Authorization": f"Bearer {session.key}"})
        assert_openai_error(models, 404, "not_found_error")
    assert len(engine.prompts) == 1 and len(session.forest.nodes) == 3


async def test_sessions_cannot_touch_each_other(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["hi", "bye", "hello"])
    async with running_gateway(template, engine) as gw:
        a, b = gw.open_session(), gw.open_session()
        history = [{"role": "user", "content": "hello"}]
        async with gw.sdk(a) as client_a:
            await client_a.chat.completions.create(model="m", messages=history)
            assert (len(a.forest.nodes), len(b.forest.nodes)) == (3, 0)
            history += [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
            await client_a.chat.completions.create(model="m", messages=history)
            assert (len(a.forest.nodes), len(b.forest.nodes)) == (5, 0)
        async with gw.sdk(b) as client_b:
            await client_b.chat.completions.create(model="m", messages=history)
        # B's forest knows nothing of A's turns: the same history starts a fresh tree with a full render.
        assert (len(a.forest.nodes), len(b.forest.nodes)) == (5, 3)
        assert b.forest.nodes[1].messages == a.forest.nodes[1].messages + a.forest.nodes[2].messages \
            + a.forest.nodes[3].messages
        assert engine.prompts[2] == template.prompt_ids(b.forest.nodes[1].messages, b.forest.nodes[0].context)
        assert a.forest.forks == [] and b.forest.forks == []


# --- generations that do not finish -------------------------------------------------------------


async def test_aborted_generation_commits_nothing(template: ChatTemplate, tokenizer: Any) -> None:
    engine = AbortingEngine(tokenizer, ["first", "second", "second"], abort_at=1)
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        history = [{"role": "user", "content": "one"}]
        assert (await gw.post(session, {"messages": history})).status_code == 200
        history += [{"role": "assistant", "content": "first"}, {"role": "user", "content": "two"}]
        aborted = assert_openai_error(await gw.post(session, {"messages": history}), 499, "client_closed_request")
        assert "aborted" in aborted["message"]
        assert kinds(session) == ["root", "observation", "response"] and session.forest.forks == []
        retried = await gw.post(session, {"messages": history})
        assert retried.status_code == 200 and retried.json()["choices"][0]["message"]["content"] == "second"
    assert kinds(session) == ["root", "observation", "response", "observation", "response"]
    assert engine.prompts[2] == engine.prompts[1]


async def test_engine_failure_answers_500_and_commits_nothing(template: ChatTemplate, tokenizer: Any) -> None:
    engine = FailingEngine(tokenizer, ["never"])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        error = assert_openai_error(await gw.post(session, HELLO), 500, "server_error")
        assert "engine worker died" in error["message"]
    assert len(engine.prompts) == 1 and session.forest.nodes == []
