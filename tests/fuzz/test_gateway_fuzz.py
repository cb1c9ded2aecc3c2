"""Schema fuzzing: schemathesis against a live gateway (uvicorn on 127.0.0.1:0, scripted engine), every route.

Requests are generated from the gateway's own OpenAPI document (`gateway/openapi.py`, served at
`{prefix}/openapi.json`), valid ones and ones that break the schema, `RELAX_FUZZ_CASES` per operation
(default 150). Every answer must pass schemathesis' checks (no 5xx, a documented status, a documented
content type, the body in the documented shape: errors in the provider's error shape), and every 400 must
name the field: `param` on OpenAI routes, a `field: ` prefix on Anthropic ones (except for bodies that are
not JSON objects, which have no field). A schema-valid body may still be a 400 (`positive_data_acceptance` is
not checked): JSON Schema cannot say that an assistant message may not come last, that a tool result needs
its call, or that a prompt must fit the context; such 400s are held to the same shape and field rules. Nor is
`negative_data_rejection`: the gateway is lenient on purpose (docs/design.md §3.3: what it does not use is accepted
and ignored; `null` reads as absent), so a body outside the schema may be answered 200. The number of cases
tried and of 500s seen is printed at the end.

Run: `pip install -e '.[fuzz]' && pytest -m fuzz tests/fuzz -s` (not part of the default run).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz tier needs pip install -e '.[fuzz]'")
from hypothesis import HealthCheck, settings  # noqa: E402 - after the importorskip above
from schemathesis.checks import negative_data_rejection, positive_data_acceptance  # noqa: E402

from relax_pipeline.chat.parsers import OutputParser  # noqa: E402
from relax_pipeline.chat.template import ChatTemplate  # noqa: E402
from relax_pipeline.gateway.app import create_app  # noqa: E402
from relax_pipeline.gateway.openapi import openapi_document  # noqa: E402
from relax_pipeline.gateway.server import GatewayServer  # noqa: E402
from relax_pipeline.protocol.suite import ProtocolSuite  # noqa: E402
from relax_pipeline.testing.engines import ScriptedEngine  # noqa: E402
from relax_pipeline.turn.service import SamplingDefaults, TurnService  # noqa: E402  # noqa: E402
from relax_pipeline.turn.sessions import ForestStore, Status  # noqa: E402  # noqa: E402

PREFIX = "/agentic_api"
APIS = ["chat", "responses", "messages"]
CASES = int(os.environ.get("RELAX_FUZZ_CASES", "150"))
SCHEMA = schemathesis.openapi.from_dict(openapi_document(PREFIX, APIS))
SEEN: Counter[str] = Counter()
"""Cases tried per operation, and `500` for server errors seen."""


@dataclass
class Live:
    """A gateway serving in its own thread and event loop; `key` opens its one running session."""

    url: str
    key: str
    store: ForestStore


def _serve(template: ChatTemplate, engine: ScriptedEngine, ready: list[Any], stop: threading.Event) -> None:
    async def main() -> None:
        store = ForestStore()
        suite = ProtocolSuite(apis=APIS)
        turns = TurnService(template, engine, OutputParser(), SamplingDefaults(max_response_len=16))
        server = GatewayServer(create_app(store, turns, prefix=PREFIX, frontends=suite.frontends()), prefix=PREFIX)
        await server.start()
        session = store.open("g0-0-fuzz", 0, 0, "train", {})
        store.set_status(session, Status.RUNNING)
        ready.append(Live(f"http://{server.host}:{server.port}", session.key, store))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop()

    asyncio.run(main())


@pytest.fixture(scope="module")
def live(template: ChatTemplate, tokenizer: Any) -> Iterator[Live]:
    ready: list[Any] = []
    stop = threading.Event()
    engine = ScriptedEngine(tokenizer, ["Hello.", "<tool_call>\n{\"name\": \"calc\", \"arguments\": {}}\n</tool_call>"],
                            record_prompts=False)
    thread = threading.Thread(target=_serve, args=(template, engine, ready, stop), daemon=True)
    thread.start()
    while not ready and thread.is_alive():
        threading.Event().wait(0.05)
    assert ready, "the gateway did not start"
    yield ready[0]
    stop.set()
    thread.join(timeout=30)


@SCHEMA.parametrize()
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_gateway_answers_every_generated_request_in_shape(case: Any, live: Live) -> None:
    response = case.call(base_url=live.url, headers={"Authorization": f"Bearer {live.key}"}, timeout=30)
    SEEN[case.operation.label] += 1
    SEEN["500"] += response.status_code >= 500
    assert response.status_code < 500, response.text
    case.validate_response(response, excluded_checks=[positive_data_acceptance, negative_data_rejection])
    if response.status_code == 400:
        assert_names_the_field(case, response.json())


def assert_names_the_field(case: Any, body: dict[str, Any]) -> None:
    """A 400 for a JSON object body names the field to fix (OpenAI `param`; Anthropic `field: message`)."""
    if not isinstance(case.body, dict):
        return
    if "error" in body and body.get("type") == "error":
        message = body["error"]["message"]
        assert ": " in message and " " not in message.split(": ", 1)[0], message
    else:
        assert body["error"]["param"], body
