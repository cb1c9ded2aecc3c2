"""Session isolation over real HTTP: only a session's own secret key opens it, and a refused request
reads or changes nothing.

Every request here that names another session (its id, which run.log and the dump show), a forged id, no
credential, or a key of a finished session is answered 401 or 404 in the provider's error shape, on every
route of the three protocols, and afterwards every session's forest, responses and status are exactly as
before and the engine generated nothing. Keys are random and share nothing with the session id.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_gateway import Gateway, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.sessions import ForestStore, Session, Status

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
ROUTES = [("v1/chat/completions", CHAT), ("chat/completions", CHAT), ("v1/responses", {"model": "m", "input": "hi"}),
          ("v1/messages", MESSAGES), ("messages", MESSAGES), ("v1/messages/count_tokens", MESSAGES)]


def fingerprint(store: ForestStore) -> list[Any]:
    """Everything a request could read into or write in a session."""
    return [(s.id, s.status, s.error, s.in_flight, s.forest.turn_count, dict(s.responses), list(s.forest.forks),
             [(n.kind, n.messages, tuple(n.token_ids)) for n in s.forest.nodes])
            for s in store]


def credentials(victim: Session, finished: Session) -> dict[str, dict[str, str]]:
    """Headers that must not open `victim`: its id (both headers), forged ids and keys, nothing at all."""
    return {
        "victim-id-bearer": {"Authorization": f"Bearer {victim.id}"},
        "victim-id-x-api-key": {"x-api-key": victim.id},
        "forged-id": {"Authorization": "Bearer sess-" + "0" * 24},
        "forged-key": {"Authorization": "Bearer rk-" + "A" * 32},
        "key-with-prefix-of-victim-key": {"Authorization": f"Bearer {victim.key[:-1]}"},
        "no-credential": {},
        "empty-bearer": {"Authorization": "Bearer"},
        "finished-session-key": {"Authorization": f"Bearer {finished.key}"},
    }


async def started(gw: Gateway) -> tuple[Session, Session, Session]:
    """An attacker, a victim with two committed turns (one through Responses) and a finished session."""
    attacker, victim, finished = gw.open_session(), gw.open_session(), gw.open_session()
    for session in (victim, finished):
        assert (await gw.post(session, CHAT)).status_code == 200
    reply = await gw.post(victim, {"model": "m", "input": "hi"}, "v1/responses")
    assert reply.status_code == 200, reply.text
    gw.store.set_status(finished, Status.COMPLETED)
    return attacker, victim, finished


async def test_no_foreign_or_forged_credential_reads_or_changes_anything(template: ChatTemplate,
                                                                         tokenizer: Any) -> None:
    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"] * 4), frontends=frontends) as gw:
        attacker, victim, finished = await started(gw)
        before, prompts = fingerprint(gw.store), len(gw.engine.prompts)
        tried = 0
        for name, headers in credentials(victim, finished).items():
            for path, body in ROUTES:
                answer = await gw.post(None, body, path, headers=headers)
                tried += 1
                expected = 404 if name == "finished-session-key" else 401
                assert answer.status_code == expected, (name, path, answer.text)
                error = answer.json()
                assert error.get("type") == "error" or set(error["error"]) == {"message", "type", "param", "code"}
                assert victim.key not in answer.text and "hi" not in answer.text.split("error")[0]
            models = await gw.http.get(gw.base_url + "v1/models", headers=headers)
            assert models.status_code in (401, 404), (name, models.text)
        assert fingerprint(gw.store) == before and len(gw.engine.prompts) == prompts
        assert tried == 48
        # The attacker's own key works and touches only the attacker's forest.
        assert (await gw.post(attacker, CHAT)).status_code == 200
        assert fingerprint(gw.store)[1:] == before[1:]


async def test_a_session_id_is_refused_with_a_hint_to_send_the_key(template: ChatTemplate, tokenizer: Any) -> None:
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"])) as gw:
        session = gw.open_session()
        answer = await gw.post(None, CHAT, headers={"Authorization": f"Bearer {session.id}"})
        assert answer.status_code == 401 and "RELAX_API_KEY" in answer.json()["error"]["message"]
        assert session.forest.nodes == []


async def test_a_continuation_by_another_sessions_response_id_reads_nothing(template: ChatTemplate,
                                                                           tokenizer: Any) -> None:
    async with running_gateway(template, ScriptedEngine(tokenizer, ["secret answer", "x"]),
                               frontends=[ResponsesFrontend()]) as gw:
        victim, attacker = gw.open_session(), gw.open_session()
        first = await gw.post(victim, {"model": "m", "input": "tell me"}, "v1/responses")
        assert first.status_code == 200, first.text
        before = fingerprint(gw.store)
        body = {"model": "m", "input": "and?", "previous_response_id": first.json()["id"]}
        answer = await gw.post(attacker, body, "v1/responses")
        assert 400 <= answer.status_code < 500 and "secret" not in answer.text, answer.text
        assert answer.json()["error"]["param"] == "previous_response_id"
        assert fingerprint(gw.store) == before and len(gw.engine.prompts) == 1
