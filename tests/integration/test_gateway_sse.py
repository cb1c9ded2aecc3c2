"""Buffered SSE and disconnects on the Chat front-end: the real openai SDK streaming against the real
gateway, heartbeats from a slow engine, a golden transcript per protocol (reasoning, text and a tool
call), and a client that leaves mid-generation.

Golden transcripts, one per protocol: `tests/golden/sse_{chat,responses,messages}.txt`, regenerated with
`RELAX_REGEN_GOLDEN=1 python -m pytest tests/integration/test_gateway_sse.py -k golden`.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_gateway import ANSWER, THINK_AND_CALL, TOOLS, generated_ids, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
GOLDEN = Path(__file__).parent.parent / "golden"
REQUESTS = {
    "chat": ("v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}]}),
    "responses": ("v1/responses", {"model": "m", "input": "hello", "tools": [
        {"type": "function", "name": "calc", "parameters": {"type": "object"}}]}),
    "messages": ("v1/messages", {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}),
}
USER = {"role": "user", "content": "hello"}
GOLDEN_SCRIPT = THINK_AND_CALL.replace("</think>\n\n", "</think>\n\nLet me add.\n")
"""Reasoning, text and a tool call: every kind of output item/block in each transcript."""


async def test_sdk_stream_gets_the_whole_message_in_one_chunk(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [THINK_AND_CALL])
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        stream = await gw.sdk(session).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x=1, add one"}], tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
    assert len(chunks) == 1
    choice = chunks[0].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.delta.tool_calls[0].function.name == "calc"
    assert chunks[0].usage.completion_tokens == len(generated_ids(tokenizer, THINK_AND_CALL))
    assert chunks[0].usage.prompt_tokens == len(engine.prompts[0])
    assert session.forest.turn_count == 1


async def test_heartbeats_while_a_slow_engine_generates(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER], delay_s=0.35)
    async with running_gateway(template, engine, heartbeat_s=0.1) as gw:
        session = gw.open_session()
        body = gw.post_stream(session, {"messages": [USER], "stream": True})
        text = await body
    assert text.startswith(": connected\n\n")
    assert text.count(": ping\n\n") >= 2
    assert text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("protocol", list(REQUESTS))
async def test_golden_transcript(template: ChatTemplate, tokenizer: Any, protocol: str) -> None:
    engine = ScriptedEngine(tokenizer, [GOLDEN_SCRIPT])
    frontends = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]
    path, body = REQUESTS[protocol]
    async with running_gateway(template, engine, frontends=frontends) as gw:
        text = await gw.post_stream(gw.open_session(), dict(body, stream=True), path)
    golden = GOLDEN / f"sse_{protocol}.txt"
    if os.environ.get("RELAX_REGEN_GOLDEN"):
        golden.write_text(_stable(text))
    assert _stable(text) == golden.read_text()


def _stable(text: str) -> str:
    """The transcript with its random ids and clock values replaced."""
    text = re.sub(r"(chat|responses|messages)-[0-9a-f]{24}", r"\1-ID", text)
    text = re.sub(r"(call_|toolu_|msg_|rs_|fc_)[0-9a-f]{8,}", r"\1ID", text)
    return re.sub(r'"(created|created_at)": \d+', r'"\1": 0', text)


async def test_client_that_leaves_aborts_and_commits_nothing(template: ChatTemplate, tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [ANSWER], delay_s=5.0)
    async with running_gateway(template, engine) as gw:
        session = gw.open_session()
        with pytest.raises(httpx.ReadTimeout):
            await gw.post(session, {"messages": [USER]}, timeout=0.3)
        await asyncio.sleep(1.0)
        assert session.forest.nodes == [] and session.in_flight == 0
