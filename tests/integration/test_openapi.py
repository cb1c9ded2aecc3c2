"""`GET {prefix}/openapi.json`: the OpenAPI document of exactly the routes a gateway serves, no credential
needed; `tests/fuzz` generates its requests from the same document."""

from __future__ import annotations

from typing import Any

import pytest
from test_gateway import PREFIX, running_gateway

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.gateway.openapi import openapi_document
from relax_pipeline.protocol.messages import MessagesFrontend
from relax_pipeline.testing.engines import ScriptedEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


async def test_the_document_lists_the_served_routes_with_typed_bodies(template: ChatTemplate,
                                                                      tokenizer: Any) -> None:
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"])) as gw:
        chat_only = (await gw.http.get(gw.root_url + PREFIX + "/openapi.json")).json()
    assert chat_only == openapi_document(PREFIX, ["chat"])
    assert chat_only["openapi"].startswith("3.0") and set(chat_only["paths"]) == {
        f"{PREFIX}/v1/chat/completions", f"{PREFIX}/v1/models"}
    body = chat_only["paths"][f"{PREFIX}/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["required"] == ["messages"]
    async with running_gateway(template, ScriptedEngine(tokenizer, ["hi"]), frontends=[MessagesFrontend()]) as gw:
        messages = (await gw.http.get(gw.root_url + PREFIX + "/openapi.json")).json()
    error = messages["paths"][f"{PREFIX}/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]
    assert error["schema"]["properties"]["type"]["enum"] == ["error"], "Messages routes document Anthropic errors"
    assert f"{PREFIX}/v1/messages/count_tokens" in messages["paths"]
