"""smg (Shepherd Model Gateway, the `smg` package: sglang-router's maintained successor) in front of the SGLang
servers with `engine.router=smg`: its command, whether it is installed, and its RL control plane.

smg is started by `sglang/launch.py` (`router_command`: `<engine.router_command> --host H --port P --worker-urls
U... --policy manual --assignment-mode min_load --enable-rl --prometheus-port X <engine.router_args>`), or a
running one is reached at `engine.router_url`. Generations go through it with their routing key in
`x-smg-routing-key` (`sglang/routing.py`): its `manual` policy keeps a key on the worker it first gave it, so a
session's turns and a group's siblings meet their cached prefix.

`RlControl` is smg's RL control plane (`--enable-rl`, `/v1/rl/*`, as `smg/rl.py` of smg 1.13.0 calls it):
`GET /v1/rl/workers` lists the workers (checked against the engine's servers at start), and `fanout(path, body)`
sends `POST /v1/rl/engine/<path>?selector=engine=sglang`, which smg forwards to every SGLang worker at once and
answers per worker (`results` by worker id, each with its `url`, `status` and `body`; `failed` for the workers it
could not reach). Pause, continue, the weight-update session and disk or tensor loads go through it. Not through
it, sent to each server directly: the distributed transfer's group calls (each server gets its own rank offset),
sessions (smg does not route `/open_session`: they open on every worker) and aborts (smg answers 404 for
`/abort_request`). A running smg without the control plane (`/v1/rl/workers` answers 404) gets the direct calls,
said once at start.

`check_installed` refuses `engine.router=smg` at start when the command's program is missing, naming the key and
the fix.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relax_pipeline.engine.sglang.wire import SglangError

log = logging.getLogger(__name__)
SELECTOR = "engine%3Dsglang"
"""The fan-out's worker selector, `engine=sglang` (every SGLang worker smg knows), URL-encoded."""
Call = Callable[..., Awaitable[Any]]
"""`SglangEngine._call(method, url, path, body)`."""


def check_installed(command: str) -> None:
    """Refuse an smg command whose program is missing here: `python -m smg...` without the `smg` package in that
    interpreter (this one), or an executable not on PATH."""
    words = shlex.split(command)
    module = words[2] if len(words) > 2 and words[1] == "-m" else None
    if module is not None and _same_python(words[0]):
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    else:
        found = shutil.which(words[0]) is not None if words else False
    if not found:
        raise ValueError(f"engine.router=smg starts `{command}` (engine.router_command), but "
                         f"{module or (words[0] if words else 'it')} is not installed here: pip install "
                         "'relax-pipeline[router]' (smg==1.13.0), or point engine.router_url at a running smg")


def _same_python(program: str) -> bool:
    path = shutil.which(program) or program
    return os.path.realpath(path) == os.path.realpath(sys.executable)


class RlControl:
    """smg's RL control plane over the engine's servers (see the module)."""

    def __init__(self, call: Call, router: str, urls: Sequence[str]) -> None:
        self.call, self.router, self.urls = call, router, list(urls)

    @classmethod
    async def connect(cls, call: Call, router: str, urls: Sequence[str]) -> RlControl | None:
        """The control plane of the smg at `router` once it lists exactly `urls`; None when it has none (404)."""
        try:
            listed = await call("GET", router, "/v1/rl/workers")
        except SglangError as error:
            if "(404)" not in str(error):
                raise
            log.warning("smg at %s has no RL control plane (start it with --enable-rl): pause, continue and weight "
                        "loads go to each server directly", router)
            return None
        seen = sorted(str(w.get("url", "")).rstrip("/") for w in listed.get("workers", []))
        if seen != sorted(urls):
            raise SglangError(f"smg at {router} lists the workers {seen}, not this engine's servers {sorted(urls)}; "
                              "start it with --worker-urls of exactly engine.urls (or let the engine launch it)")
        return cls(call, router, urls)

    async def fanout(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST `body` to `path` on every worker through smg; their answers in `urls` order."""
        answer = await self.call("POST", self.router, f"/v1/rl/engine{path}?selector={SELECTOR}", body)
        failed = answer.get("failed") or []
        if failed:
            where = [(f.get("url"), f.get("message")) for f in failed]
            raise SglangError(f"smg at {self.router}: {path} failed on {where}")
        by_url = {str(r.get("url", "")).rstrip("/"): r.get("body") for r in (answer.get("results") or {}).values()}
        missing = [url for url in self.urls if url not in by_url]
        if missing:
            raise SglangError(f"smg at {self.router}: {path} reached no worker at {missing}")
        return [by_url[url] if by_url[url] is not None else {} for url in self.urls]
