"""`GatewayServer` writes each response as one send (`OneSend`): responses of many sizes arrive whole, in order, on
one keep-alive connection."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI

from relax_pipeline.gateway.server import GatewayServer


def test_responses_arrive_whole_over_keep_alive() -> None:
    app = FastAPI()

    @app.get("/agentic_api/echo/{n}")
    async def echo(n: int) -> dict[str, Any]:
        return {"n": n, "pad": "x" * (n * 997)}

    async def go() -> list[int]:
        server = GatewayServer(app)
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.base_url) as client:
                replies = [await client.get(f"echo/{n}") for n in range(0, 200, 37)]
        finally:
            await server.stop()
        return [r.json()["n"] for r in replies if len(r.json()["pad"]) == r.json()["n"] * 997]

    assert asyncio.run(go()) == list(range(0, 200, 37))
