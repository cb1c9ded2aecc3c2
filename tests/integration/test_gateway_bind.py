"""Gateway bind, address and credentials over real HTTP: uvicorn on 0.0.0.0 (and ::) reached through this
machine's non-loopback address, and on 127.0.0.1, with the real `openai` and `anthropic` SDKs.

`gateway.allow_remote=true` (the app built with `session_ids=False`): only a session's `RELAX_API_KEY` opens
it; its id gets 401 naming RELAX_API_KEY. Loopback (`session_ids=True`, what the run passes when
`gateway.allow_remote=false`): the session's own `RELAX_SESSION_ID` opens it too (docs/design.md §3.3). Either way a
credential opens only its own session: session A's credential never reads or changes session B's forest,
B's response ids included, and a 401 or 404 changes nothing anywhere (forests, responses, statuses, the
engine's prompts).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from test_gateway import PREFIX, Gateway
from test_session_isolation import CHAT, ROUTES, fingerprint

from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.gateway.app import create_app
from relax_pipeline.gateway.server import GatewayServer, machine_address
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore, Session, Status

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


@asynccontextmanager
async def serving(template: ChatTemplate, engine: ScriptedEngine, host: str, allow_remote: bool,
                  port: int = 0) -> AsyncIterator[Gateway]:
    """The three front-ends under a real server on `host`, credentials as the run sets them."""
    store = ForestStore()
    turns = TurnService(template, engine, OutputParser(), SamplingDefaults())
    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    app = create_app(store, turns, prefix=PREFIX, frontends=frontends, session_ids=not allow_remote)
    server = GatewayServer(app, host, port, PREFIX, allow_remote=allow_remote)
    await server.start()
    try:
        async with httpx.AsyncClient() as http:
            yield Gateway(server, store, engine, http)
    finally:
        await server.stop()


def lan_address(family: socket.AddressFamily = socket.AF_INET) -> str:
    """This machine's non-loopback address of `family`, or skip naming why."""
    address = machine_address("::" if family == socket.AF_INET6 else "0.0.0.0")
    if address in ("127.0.0.1", "::1"):
        pytest.skip(f"this machine has no non-loopback {family.name} address to reach a wildcard bind through")
    return address


async def victim_with_history(gw: Gateway) -> tuple[Session, Session, str]:
    """Sessions A (attacker) and B (victim); B has a Chat turn and a Responses turn, whose id is returned."""
    a, b = gw.open_session(), gw.open_session()
    assert (await gw.post(b, CHAT)).status_code == 200
    reply = await gw.post(b, {"model": "m", "input": "remember: zebra-secret"}, "v1/responses")
    assert reply.status_code == 200, reply.text
    return a, b, reply.json()["id"]


async def assert_refused_everywhere(gw: Gateway, headers: dict[str, str], status: int) -> None:
    """Every model route (and models) answers `status` to `headers`; nothing anywhere changes."""
    before, prompts = fingerprint(gw.store), len(gw.engine.prompts)
    for path, body in ROUTES:
        answer = await gw.post(None, body, path, headers=headers)
        assert answer.status_code == status, (headers, path, answer.text)
    assert (await gw.http.get(gw.base_url + "v1/models", headers=headers)).status_code == status
    assert fingerprint(gw.store) == before and len(gw.engine.prompts) == prompts


async def assert_foreign_response_id_reads_nothing(gw: Gateway, credential: str, foreign_id: str) -> None:
    """A continuation of another session's response, by `credential`: a 400 on previous_response_id and
    no change anywhere."""
    before, prompts = fingerprint(gw.store), len(gw.engine.prompts)
    body = {"model": "m", "input": "and?", "previous_response_id": foreign_id}
    answer = await gw.post(None, body, "v1/responses", headers={"Authorization": f"Bearer {credential}"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "previous_response_id", answer.text
    assert "zebra-secret" not in answer.text
    assert fingerprint(gw.store) == before and len(gw.engine.prompts) == prompts


async def test_a_wildcard_bind_serves_other_hosts_with_keys_only(template: ChatTemplate, tokenizer: Any) -> None:
    address = lan_address()
    engine = ScriptedEngine(tokenizer, ["hi"] * 8)
    async with serving(template, engine, "0.0.0.0", allow_remote=True) as gw:
        assert gw.base_url == f"http://{address}:{gw.server.port}{PREFIX}/"
        a, b, b_response = await victim_with_history(gw)
        b_before = fingerprint(gw.store)[1]
        sdk = openai.AsyncOpenAI(base_url=gw.base_url, api_key=a.key, max_retries=0)
        reply = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
        assert reply.choices[0].message.content == "hi" and a.forest.turn_count == 1
        assert fingerprint(gw.store)[1] == b_before
        with pytest.raises(openai.AuthenticationError, match="RELAX_API_KEY"):
            await openai.AsyncOpenAI(base_url=gw.base_url, api_key=a.id, max_retries=0).models.list()
        for credential in (a.id, b.id, "sess-" + "0" * 24, b.key[:-1]):
            await assert_refused_everywhere(gw, {"Authorization": f"Bearer {credential}"}, 401)
            await assert_refused_everywhere(gw, {"x-api-key": credential}, 401)
        await assert_foreign_response_id_reads_nothing(gw, a.key, b_response)
        gw.store.set_status(b, Status.COMPLETED)
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {b.key}"}, 404)
        assert gw.store.release(b)
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {b.key}"}, 404)
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {b.id}"}, 401)


async def test_an_ipv6_wildcard_bind_is_reached_through_this_machines_address(template: ChatTemplate,
                                                                              tokenizer: Any) -> None:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 support")
    address = lan_address(socket.AF_INET6)
    async with serving(template, ScriptedEngine(tokenizer, ["hi"]), "::", allow_remote=True) as gw:
        assert gw.base_url == f"http://[{address}]:{gw.server.port}{PREFIX}/"
        session = gw.open_session()
        assert (await gw.post(session, CHAT)).json()["choices"][0]["message"]["content"] == "hi"
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {session.id}"}, 401)


async def test_loopback_session_id_opens_only_its_own_session(template: ChatTemplate, tokenizer: Any) -> None:
    async with serving(template, ScriptedEngine(tokenizer, ["hi"] * 8), "127.0.0.1", allow_remote=False) as gw:
        assert gw.base_url == f"http://127.0.0.1:{gw.server.port}{PREFIX}/"
        a, b, b_response = await victim_with_history(gw)
        before = fingerprint(gw.store)
        sdk = openai.AsyncOpenAI(base_url=gw.base_url, api_key=a.id, max_retries=0)
        reply = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hello"}])
        assert reply.choices[0].message.content == "hi" and a.forest.turn_count == 1
        assert fingerprint(gw.store)[1] == before[1]  # B untouched by A's id
        claude = anthropic.AsyncAnthropic(base_url=gw.base_url.rstrip("/"), api_key=b.id, max_retries=0)
        message = await claude.messages.create(model="m", max_tokens=8,
                                               messages=[{"role": "user", "content": "hello"}])
        assert message.content[0].text == "hi" and b.forest.turn_count == 3
        assert fingerprint(gw.store)[0][4] == 1  # A untouched by B's id
        await assert_foreign_response_id_reads_nothing(gw, a.id, b_response)
        await assert_foreign_response_id_reads_nothing(gw, a.key, b_response)
        for forged in ("sess-" + "0" * 24, a.id[:-1], a.id.upper(), "rk-" + "A" * 32):
            await assert_refused_everywhere(gw, {"Authorization": f"Bearer {forged}"}, 401)
        gw.store.set_status(b, Status.COMPLETED)
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {b.id}"}, 404)
        await assert_refused_everywhere(gw, {"x-api-key": b.id}, 404)
        assert gw.store.release(b)  # forgotten once its rows are written: its id still gets a 404
        await assert_refused_everywhere(gw, {"Authorization": f"Bearer {b.id}"}, 404)


async def test_a_configured_port_is_bound_and_a_taken_one_is_named(template: ChatTemplate, tokenizer: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with serving(template, ScriptedEngine(tokenizer, ["hi"]), "127.0.0.1", False, port) as gw:
        assert gw.server.port == port and gw.base_url == f"http://127.0.0.1:{port}{PREFIX}/"
        assert (await gw.http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        with pytest.raises(ValueError, match=f"gateway.port={port}: cannot bind"):
            await GatewayServer(gw.server.app, "127.0.0.1", port, PREFIX).start()


async def test_a_trusted_proxys_headers_reach_every_route_but_the_model_turns(template: ChatTemplate,
                                                                              tokenizer: Any) -> None:
    """uvicorn's proxy-header middleware wraps the fallback routes only (`server.proxied`): behind a TLS proxy on
    this host, FastAPI's trailing-slash redirect still names https; a model turn, which reads neither the client
    nor the scheme, is served as before."""
    forwarded = {"x-forwarded-proto": "https", "x-forwarded-for": "203.0.113.7"}
    async with serving(template, ScriptedEngine(tokenizer, ["hi"]), "127.0.0.1", allow_remote=False) as gw:
        redirect = await gw.http.get(gw.base_url + "v1/models/", headers=forwarded)
        assert redirect.status_code == 307
        assert redirect.headers["location"] == f"https://127.0.0.1:{gw.server.port}{PREFIX}/v1/models"
        session = gw.open_session()
        answer = await gw.post(session, CHAT, headers=forwarded)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "hi"
