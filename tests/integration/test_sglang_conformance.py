"""The SGLang client and its fake checked against SGLang's own source: the wheel of the pinned release
(`SGLANG_API_VERSION`), read with `zipfile` + `ast`, never imported (no GPU, no SGLang install).

From the wheel: the routes of `sglang/srt/entrypoints/http_server.py` (method, path, and the request class
each one parses its body into), the fields of those classes in `sglang/srt/managers/io_struct.py` (bases
included; `SessionParams` for `session_params`), and the `/generate` JSON contract of
`sglang/api/v1/api_types.py` (`GenerateRequest`, and `SamplingParams`, whose unknown keys SGLang refuses).
The client (`engine/sglang*.py`) fails the test when it calls a route or sends a field the release lacks: it
runs every feature against the fake, which records each field it receives, and every route string in its
modules must be a route of the release (or of sglang-router, `ROUTER_ROUTES`). The fake
(`testing/sglang_server.py`) fails it when its table accepts a route or field the release would refuse.

The wheel is downloaded once (`pip download --no-deps sglang==VERSION`, about 39 MB) into the test cache
(`$RELAX_TEST_CACHE/sglang-wheels`, else `~/.cache/relax_pipeline/sglang-wheels`) and read from there after.
Without it the test skips, naming the cause; under CI (`RELAX_REQUIRE_EXTRAS` set, tests/conftest.py) it fails.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang import client as client_module
from relax_pipeline.engine.sglang.client import SGLANG_API_VERSION, SglangEngine
from relax_pipeline.testing import sglang_server as fake_module
from relax_pipeline.testing.sglang_server import FakeSglangServer

pytestmark = pytest.mark.integration
SOURCES = ("sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py", "sglang/api/v1/api_types.py")
CLIENT_MODULES = ("client.py", "wire.py", "weights.py", "routing.py", "launch.py", "sessions.py", "media.py",
                  "placement.py")
"""The modules of `relax_pipeline/engine/sglang/` that name server routes."""
ROUTER_ROUTES = {"/workers"}
"""Routes the client calls on sglang-router, not on an SGLang server (the router is a Rust binary: no source)."""
NESTED = {"sampling_params": "SamplingParams", "session_params": "SessionParams"}
"""Body fields that are objects, and the class that lists their fields (contract or io_struct)."""


@dataclass(frozen=True)
class SglangApi:
    """What one SGLang release accepts over HTTP, read from its source."""

    routes: dict[tuple[str, str], str | None]
    """(method, path) → the class its body is parsed into (None: no body)."""
    structs: dict[str, frozenset[str]]
    """io_struct class → its fields (bases included)."""
    contract: dict[str, frozenset[str]]
    """api_types class → its fields (the `/generate` JSON contract)."""

    def fields(self, method: str, path: str) -> frozenset[str]:
        """The body fields `method path` takes (for `/generate`: in both the dataclass and the contract)."""
        body = self.routes[(method, path)]
        if body is None:
            return frozenset()
        fields = self.structs[body]
        return fields & self.contract["GenerateRequest"] if body == "GenerateReqInput" else fields

    def nested(self, name: str) -> frozenset[str]:
        return self.contract.get(name) or self.structs[name]

    def refusals(self, sent: set[str]) -> list[str]:
        """The entries of `sent` (`METHOD /path field[.inner]`) this release does not have."""
        bad = []
        for entry in sorted(sent):
            method, path, name = entry.split(" ")
            outer, _, inner = name.partition(".")
            if (method, path) not in self.routes:
                bad.append(f"{entry}: no route {method} {path}")
            elif outer not in self.fields(method, path):
                bad.append(f"{entry}: {self.routes[(method, path)]} has no field {outer}")
            elif inner and inner not in self.nested(NESTED[outer]):
                bad.append(f"{entry}: {NESTED[outer]} has no field {inner}")
        return bad


def wheel_path(version: str = SGLANG_API_VERSION) -> Path:
    """The cached wheel of SGLang `version`, downloaded on first use (skip, or under CI fail, without it)."""
    base = os.environ.get("RELAX_TEST_CACHE")
    cache = Path(base) / "sglang-wheels" if base else Path.home() / ".cache" / "relax_pipeline" / "sglang-wheels"
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               f"sglang=={version}", "-d", str(cache)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        why = done.stderr.strip()[-500:] if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as error:
        why = repr(error)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    reason = (f"the SGLang {version} wheel (the `.[sglang]` extra's package, read here, not installed) could not "
              f"be fetched with `{' '.join(command[2:])}`: {why or 'no wheel was saved'}")
    if os.environ.get("RELAX_REQUIRE_EXTRAS"):
        pytest.fail(f"CI (RELAX_REQUIRE_EXTRAS) needs the conformance test: {reason}")
    pytest.skip(reason)


def read_api(wheel: Path) -> SglangApi:
    """Routes, request classes and the `/generate` contract of the release in `wheel` (see the module)."""
    with zipfile.ZipFile(wheel) as archive:
        trees = [ast.parse(archive.read(name).decode()) for name in SOURCES]
    return SglangApi(_routes(trees[0]), _class_fields(trees[1]), _class_fields(trees[2]))


def _routes(tree: ast.Module) -> dict[tuple[str, str], str | None]:
    routes: dict[tuple[str, str], str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = _body_class(node)
            for method, path in (r for d in node.decorator_list for r in _decorated(d)):
                routes[(method, path)] = body
    return routes


def _decorated(decorator: ast.expr) -> list[tuple[str, str]]:
    """`@app.post("/x")` → [("POST", "/x")]; `@app.api_route("/x", methods=[...])` → one per method."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"
            and decorator.args and isinstance(decorator.args[0], ast.Constant)):
        return []
    path, kind = decorator.args[0].value, decorator.func.attr
    if kind != "api_route":
        return [(kind.upper(), path)] if kind in ("get", "post", "put", "delete", "head") else []
    methods = next((k.value for k in decorator.keywords if k.arg == "methods"), None)
    return [(m.value, path) for m in getattr(methods, "elts", []) if isinstance(m, ast.Constant)]


def _body_class(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The class a route parses its body into: its `obj: X` or `obj: Annotated[X, Body()]` parameter."""
    for arg in function.args.args:
        annotation = arg.annotation
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.slice, ast.Tuple):
            annotation = annotation.slice.elts[0]
        if isinstance(annotation, ast.Name) and annotation.id not in ("Request", "str", "int"):
            return annotation.id
    return None


def _class_fields(tree: ast.Module) -> dict[str, frozenset[str]]:
    own: dict[str, tuple[set[str], list[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                     and "ClassVar" not in ast.unparse(s.annotation)}
            own[node.name] = (names, [b.id for b in node.bases if isinstance(b, ast.Name)])

    def resolve(name: str) -> set[str]:
        names, bases = own.get(name, (set(), []))
        return names.union(*(resolve(b) for b in bases if b in own))

    return {name: frozenset(resolve(name)) for name in own}


@pytest.fixture(scope="module")
def api() -> SglangApi:
    return read_api(wheel_path())


def test_the_wheel_is_read_as_the_release_it_is(api: SglangApi) -> None:
    assert api.routes[("POST", "/generate")] == "GenerateReqInput"
    assert api.routes[("POST", "/open_session")] == "OpenSessionReqInput"
    assert {"rid", "abort_all"} <= api.fields("POST", "/abort_request"), "BaseReq's rid is inherited"
    assert {"id", "rid", "offset", "replace"} <= api.nested("SessionParams")
    assert "max_new_tokens" in api.nested("SamplingParams")
    assert api.refusals({"POST /generate nonsense", "POST /no_such_route rid",
                         "POST /generate sampling_params.nonsense"}) == [
        "POST /generate nonsense: GenerateReqInput has no field nonsense",
        "POST /generate sampling_params.nonsense: SamplingParams has no field nonsense",
        "POST /no_such_route rid: no route POST /no_such_route"], "the check can fail"


def test_the_fake_accepts_only_what_the_release_accepts(api: SglangApi) -> None:
    sent = {f"{method} {path} {name}" for (method, path), names in fake_module.ROUTES.items() for name in names}
    sent |= {f"POST /generate sampling_params.{k}" for k in fake_module.SAMPLING_KEYS}
    sent |= {f"POST /generate session_params.{k}" for k in fake_module.SESSION_KEYS}
    assert api.refusals(sent) == []
    assert set(fake_module.ROUTES) <= set(api.routes)


def test_the_client_sends_only_what_the_release_accepts(api: SglangApi, tiny_path: Path, tmp_path: Path) -> None:
    async def exercise() -> set[str]:
        async with FakeSglangServer(tiny_path, decode_delay_s=0.01) as server:
            settings = SglangEngineSettings(urls=[server.url], admission="kv", weight_update="pause")
            engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
            await engine.start()
            try:
                await _every_feature(engine)
            finally:
                await engine.close()
            assert server.state.unknown == []
            return server.state.sent

    sent = asyncio.run(exercise())
    assert {"POST /generate session_params.rid", "POST /open_session timeout", "POST /close_session session_id",
            "POST /update_weights_from_disk model_path", "POST /abort_request rid",
            "POST /pause_generation mode"} <= sent, "every feature ran"
    assert api.refusals(sent) == []


async def _every_feature(engine: SglangEngine) -> None:
    """Plain and session turns (continued, forked), an abort, a weight update (paused), a session close."""
    prompt, greedy = list(range(3, 30)), SamplingParams(6, temperature=0.0, stop=("x",), seed=1)
    await engine.generate(prompt, greedy, "plain")
    first = await engine.generate(prompt, greedy, "t1", session_id="s")
    await engine.generate(prompt + list(first.output_ids) + [5, 6], greedy, "t2", session_id="s")
    await engine.generate(prompt[:20] + [9, 9], greedy, "fork", session_id="s")
    task = asyncio.create_task(engine.generate(prompt, SamplingParams(400, seed=2), "long"))
    await asyncio.sleep(0.3)
    await engine.abort("long")
    await task
    from transformers import AutoModelForCausalLM

    await engine.update_weights(AutoModelForCausalLM.from_pretrained(engine.model_path).state_dict(), 1)
    await engine.close_session("s")


def test_images_and_tensor_updates_send_only_what_the_release_accepts(api: SglangApi, tiny_vl_path: Path,
                                                                     tmp_path: Path) -> None:
    from PIL import Image as PILImage

    from relax_pipeline.canonical.form import image_of
    from relax_pipeline.data.media import png_data_uri

    async def exercise() -> set[str]:
        async with FakeSglangServer(tiny_vl_path) as server:
            settings = SglangEngineSettings(urls=[server.url], weight_transfer="tensor")
            engine = SglangEngine(settings, EngineRun(str(tiny_vl_path), output_dir=str(tmp_path)))
            await engine.start()
            try:
                assert engine.vision is not None
                image = image_of(png_data_uri(PILImage.new("RGB", (56, 56), (9, 99, 199))), 0, "p")
                media = [engine.vision.features(image)]
                await engine.generate([5, engine.vision.image_token_id, 6], SamplingParams(4, seed=1), "i",
                                      media=media)
                await engine.update_weights(dict(list(server.engine.model.state_dict().items())[:2]), 1)
            finally:
                await engine.close()
            assert server.state.unknown == []
            return server.state.sent

    sent = asyncio.run(exercise())
    assert {"POST /generate image_data", "POST /update_weights_from_tensor serialized_named_tensors",
            "POST /update_weights_from_tensor weight_version"} <= sent, "both features ran"
    assert api.refusals(sent) == []


def test_every_route_the_client_names_is_a_route_of_the_release(api: SglangApi) -> None:
    folder = Path(client_module.__file__).parent
    named = {m for name in CLIENT_MODULES
             for m in re.findall(r'"(/[a-z_]+)"', (folder / name).read_text())}
    server_paths = {path for _, path in api.routes}
    assert "/generate" in named and "/open_session" in named
    assert sorted(named - server_paths - ROUTER_ROUTES) == []
