"""A JSON (non-streaming) turn whose client leaves is aborted at once and commits nothing.

The gateway runs a JSON turn in the request's own task and watches the connection for the client's
disconnect (`gateway/app.py` `DisconnectWatch`); Buffered SSE has its own test in `test_gateway_sse.py`.
The engine here would answer only after 5 s, so a turn that ended within a second was aborted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from test_gateway import running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.tracking.logs import ACCESS_LOGGER

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_json_client_that_leaves_aborts_and_commits_nothing(
        template: ChatTemplate, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with running_gateway(template, ScriptedEngine(tokenizer, ["Hello."], delay_s=5.0)) as gw:
        session = gw.open_session()
        with pytest.raises(httpx.ReadTimeout):
            await gw.post(session, {"messages": [{"role": "user", "content": "Hi"}]}, timeout=0.3)
        for _ in range(50):
            if session.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        assert session.in_flight == 0, "the turn still runs after its client left"
        assert session.forest.nodes == []
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(lines) == 1 and "status=499" in lines[0] and "nothing committed" in lines[0]


async def test_a_finished_turn_leaves_no_watcher_behind(template: ChatTemplate, tokenizer: Any) -> None:
    async with running_gateway(template, ScriptedEngine(tokenizer, ["Hello."])) as gw:
        session = gw.open_session()
        before = len(asyncio.all_tasks())
        for _ in range(3):
            response = await gw.post(session, {"messages": [{"role": "user", "content": "Hi"}]})
            assert response.status_code == 200, response.text
        await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) <= before
        assert [node.kind for node in session.forest.nodes] == ["root", "observation"] + ["response"] * 3
