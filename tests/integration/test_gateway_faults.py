"""Gateway faults over real HTTP: a client that leaves mid-stream, and requests for a session that has ended.

Decided (and documented in `gateway/app.py`): a turn is committed when its generation ends. A streaming
client that leaves while the engine generates aborts the generation and nothing is committed, on every
protocol; a client that leaves after generation ended, before reading the terminal frames, leaves the
turn committed (the forest only grows). A request for a session that completed, failed or was dropped is a
404 in its provider's error shape and changes nothing, also once the store has released the session.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from test_gateway import Gateway, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.sessions import Session, Status

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

USER = {"role": "user", "content": "hello"}
STREAMS = {
    "chat": ("v1/chat/completions", {"model": "m", "messages": [USER], "stream": True}),
    "responses": ("v1/responses", {"model": "m", "input": "hello", "stream": True}),
    "messages": ("v1/messages", {"model": "m", "max_tokens": 16, "messages": [USER], "stream": True}),
}
FRONTENDS = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]


async def wait_until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def leave_after_first_frame(gw: Gateway, session: Session, api: str, until: Any = None) -> None:
    """Open a stream, read its first bytes, optionally wait for `until()`, then drop the connection."""
    path, body = STREAMS[api]
    async with httpx.AsyncClient() as client:
        headers = {"Authorization": f"Bearer {session.key}"}
        async with client.stream("POST", gw.base_url + path, json=body, headers=headers, timeout=30) as response:
            assert response.status_code == 200
            chunks = response.aiter_raw()  # kept: a dropped iterator would close the connection at once
            assert (await chunks.__anext__()).startswith((b":", b"event:"))
            if until is not None:
                await wait_until(until)


@pytest.mark.parametrize("api", list(STREAMS))
async def test_a_client_leaving_mid_stream_aborts_and_commits_nothing(api: str, template: ChatTemplate,
                                                                     tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["Hello."], delay_s=5.0)
    async with running_gateway(template, engine, heartbeat_s=0.05, frontends=FRONTENDS) as gw:
        session = gw.open_session()
        await leave_after_first_frame(gw, session, api, until=lambda: len(engine.prompts) == 1)
        await wait_until(lambda: session.in_flight == 0)
        assert session.forest.nodes == [] and session.responses == {}
        again = await gw.post(session, {"messages": [USER]})  # the session still serves, from scratch
        assert again.status_code == 200 and session.forest.turn_count == 1


@pytest.mark.parametrize("api", list(STREAMS))
async def test_a_client_leaving_after_generation_ended_keeps_the_turn(api: str, template: ChatTemplate,
                                                                     tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, ["Hello."], delay_s=0.2)
    async with running_gateway(template, engine, heartbeat_s=0.05, frontends=FRONTENDS) as gw:
        session = gw.open_session()
        await leave_after_first_frame(gw, session, api, until=lambda: session.forest.turn_count == 1)
        await wait_until(lambda: session.in_flight == 0)
        assert [node.kind for node in session.forest.nodes] == ["root", "observation", "response"]


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.FAILED, Status.DROPPED])
async def test_a_closed_session_answers_404_in_each_providers_shape(status: Status, template: ChatTemplate,
                                                                    tokenizer: Any) -> None:
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"]), frontends=FRONTENDS) as gw:
        session = gw.open_session()
        assert (await gw.post(session, {"messages": [USER]})).status_code == 200
        gw.store.set_status(session, status, None if status is Status.COMPLETED else "a reason")
        nodes = list(session.forest.nodes)
        for api, (path, body) in STREAMS.items():
            for stream in (False, True):
                answer = await gw.post(session, {**body, "stream": stream}, path)
                assert answer.status_code == 404, answer.text
                error = answer.json()
                if api == "messages":
                    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
                else:
                    assert error["error"]["type"] == "not_found_error" and error["error"]["param"] is None
                assert status.value in answer.text and session.id in answer.text
        counted = await gw.post(session, STREAMS["messages"][1], "v1/messages/count_tokens")
        assert counted.status_code == 404 and counted.json()["type"] == "error"
        assert session.forest.nodes == nodes and len(gw.engine.prompts) == 1
        assert gw.store.release(session)  # as the pipeline does once the step's rows are written
        late = await gw.post(session, {"messages": [USER]})
        assert late.status_code == 404 and status.value in late.json()["error"]["message"]
        assert len(gw.engine.prompts) == 1
