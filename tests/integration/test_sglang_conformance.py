"""The SGLang client and its fake checked against SGLang's own source: the wheel of the pinned release
(`SGLANG_API_VERSION`), read with `zipfile` + `ast`, never imported (no GPU, no SGLang install).

From the wheel: the routes of `sglang/srt/entrypoints/http_server.py` (method, path, and the request class
each one parses its body into) and the mounted ones (`Mount("/metrics", ...)` in `sglang/srt/utils/common.py`),
the fields of those classes in `sglang/srt/managers/io_struct.py` (bases included; `SessionParams` for
`session_params`), and the `/generate` JSON contract of `sglang/api/v1/api_types.py` (`GenerateRequest`, and
`SamplingParams`, whose unknown keys SGLang refuses). Both ways: requests, and answers. The client
(`engine/sglang/*.py`) fails the test when it calls a route or sends a field the release lacks (it runs every
feature against the fake, which records each field it receives, and every route string in its modules must be a
route of the release, or of smg, `ROUTER_ROUTES`), and when it reads an answer field the release does not build:
its table `wire.ANSWER_FIELDS` is checked against the keys the release's source writes (`meta_info` in
`managers/tokenizer_manager.py` and `utils/weight_versions.py`, `finish_reason` in `managers/schedule_batch.py`'s
`to_json`, `/server_info` from the server arguments' fields in `srt/arg_groups/fields/` and the scheduler's info,
`/model_info` and the update answers from their route functions, `/metrics` from the collector's series names), and
every literal key its modules read must be in that table. The fake (`testing/sglang_server.py`) fails it when its
table accepts a route or field the release would refuse, or when it answers a field the release does not build.

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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings
from relax_pipeline.engine.sglang import client as client_module
from relax_pipeline.engine.sglang import wire as wire_module
from relax_pipeline.engine.sglang.client import SGLANG_API_VERSION, SglangEngine
from relax_pipeline.testing import sglang_server as fake_module
from relax_pipeline.testing.sglang_server import FakeSglangServer

pytestmark = pytest.mark.integration
SOURCES = ("sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py", "sglang/api/v1/api_types.py")
CLIENT_MODULES = ("client.py", "wire.py", "weights.py", "routing.py", "launch.py", "sessions.py", "media.py",
                  "placement.py", "smg.py", "../program_admission.py")
"""The modules of `relax_pipeline/engine/sglang/` (and program admission) that name server routes or read answers."""
ROUTER_ROUTES = {"/workers"}
"""Routes the client calls on smg, not on an SGLang server (smg is a Rust binary; its control plane is `/v1/rl/*`)."""
ANSWER_SOURCES = ("sglang/srt/managers/tokenizer_manager.py", "sglang/srt/utils/weight_versions.py",
                  "sglang/srt/managers/schedule_batch.py", "sglang/srt/managers/scheduler.py",
                  "sglang/srt/utils/common.py", "sglang/srt/observability/metrics_collector.py")
SERVER_ARGS = "sglang/srt/arg_groups/fields/"
"""The server arguments' namespaces: `/server_info` reports their fields (`ServerArgs.resolved_dict`)."""
OWN_KEYS = {"id", "cached", "close_s", "closed", "turns", "workers", "is_healthy", "results", "failed", "url", "body"}
"""Literal keys the client's modules read that are not SGLang answers: session params and metric counters of its
own, and smg's answers (`/workers`, the RL fan-out's `results`/`failed`, `smg/rl.py` of the smg wheel)."""
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
    answers: dict[str, frozenset[str]] = field(default_factory=dict)
    """`METHOD /path` (or `meta_info`, `finish_reason`, `weight_versions`) → the keys the release writes into it."""
    mounts: frozenset[str] = frozenset()
    """Paths mounted as sub-applications (`/metrics`): routes without a decorator."""

    def fields(self, method: str, path: str) -> frozenset[str]:
        """The body fields `method path` takes (for `/generate`: in both the dataclass and the contract)."""
        body = self.routes[(method, path)]
        if body is None:
            return frozenset()
        fields = self.structs[body]
        return fields & self.contract["GenerateRequest"] if body == "GenerateReqInput" else fields

    def nested(self, name: str) -> frozenset[str]:
        return self.contract.get(name) or self.structs[name]

    def unanswered(self, reads: dict[str, frozenset[str]]) -> list[str]:
        """The entries of `reads` (`wire.ANSWER_FIELDS`' shape) the release never writes into that answer."""
        bad = []
        for route, names in sorted(reads.items()):
            for name in sorted(names):
                *outer, leaf = name.split(".")
                where = outer[-1] if outer else route
                if leaf not in self.answers.get(where, frozenset()):
                    bad.append(f"{route} {name}: the release writes no {leaf!r} into {where}")
        return bad

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
    """Routes, request classes, the `/generate` contract and the answers of the release in `wheel` (the module)."""
    with zipfile.ZipFile(wheel) as archive:
        trees = [ast.parse(archive.read(name).decode()) for name in SOURCES]
        extra = {name: ast.parse(archive.read(name).decode()) for name in ANSWER_SOURCES}
        namespaces = [ast.parse(archive.read(n).decode()) for n in archive.namelist()
                      if n.startswith(SERVER_ARGS) and n.endswith(".py")]
    answers = _answers(trees[0], extra, namespaces)
    return SglangApi(_routes(trees[0]), _class_fields(trees[1]), _class_fields(trees[2]), answers,
                     frozenset(_mounts(extra["sglang/srt/utils/common.py"])))


def _answers(http: ast.Module, extra: dict[str, ast.Module], namespaces: list[ast.Module]) -> dict[str, frozenset[str]]:
    """The keys each answer of the release is built with (see the module)."""
    spans = _keys(extra["sglang/srt/utils/weight_versions.py"])
    meta = _keys(extra["sglang/srt/managers/tokenizer_manager.py"]) | spans
    functions = _route_functions(http)
    answers = {"POST /generate": meta, "meta_info": meta,
               "finish_reason": _keys(extra["sglang/srt/managers/schedule_batch.py"], "to_json"),
               "weight_versions": spans,
               "GET /server_info": frozenset().union(*(_fields(t) for t in namespaces))
               | _keys(extra["sglang/srt/managers/scheduler.py"]) | _keys(functions[("GET", "/server_info")]),
               "GET /metrics": _series(extra["sglang/srt/observability/metrics_collector.py"])}
    for route, function in functions.items():
        answers.setdefault(f"{route[0]} {route[1]}", _keys(function))
    return answers


def _keys(tree: ast.AST, within: str | None = None) -> frozenset[str]:
    """String keys of the dict displays and `x["k"] = ...` stores in `tree` (inside functions named `within`)."""
    scopes = [tree] if within is None else [n for n in ast.walk(tree) if isinstance(
        n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == within]
    found: set[str] = set()
    for node in (n for scope in scopes for n in ast.walk(scope)):
        if isinstance(node, ast.Dict):
            found |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            found.add(node.slice.value)
    return frozenset(found)


def _fields(tree: ast.Module) -> set[str]:
    """The annotated fields of every class in `tree` (a server-arguments namespace)."""
    return {s.target.id for c in tree.body if isinstance(c, ast.ClassDef) for s in c.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _series(tree: ast.Module) -> frozenset[str]:
    """The Prometheus series the collector declares (`name="sglang:..."`)."""
    return frozenset(k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
                     if k.arg == "name" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str))


def _mounts(tree: ast.Module) -> set[str]:
    """Paths of `Mount("/path", app)` calls."""
    return {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == "Mount" and n.args and isinstance(n.args[0], ast.Constant)}


def _route_functions(tree: ast.Module) -> dict[tuple[str, str], ast.AST]:
    return {route: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for route in (r for d in node.decorator_list for r in _decorated(d))}


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
        async with FakeSglangServer(tiny_path, decode_delay_s=0.01, session_radix_cache=True) as server:
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
        async with FakeSglangServer(tiny_vl_path, session_radix_cache=True) as server:
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
    server_paths = {path for _, path in api.routes} | api.mounts
    assert "/generate" in named and "/open_session" in named and "/metrics" in named
    assert sorted(named - server_paths - ROUTER_ROUTES) == []


def test_the_release_builds_every_answer_field_the_client_reads(api: SglangApi) -> None:
    assert api.mounts >= {"/metrics"}, "SGLang's Prometheus metrics are a mount, not a decorated route"
    assert api.unanswered(wire_module.ANSWER_FIELDS) == []
    assert api.unanswered({"POST /generate": frozenset({"meta_info.nonsense", "meta_info.finish_reason.why"}),
                           "GET /server_info": frozenset({"no_such_arg"})}) == [
        "GET /server_info no_such_arg: the release writes no 'no_such_arg' into GET /server_info",
        "POST /generate meta_info.finish_reason.why: the release writes no 'why' into finish_reason",
        "POST /generate meta_info.nonsense: the release writes no 'nonsense' into meta_info"], "the check can fail"


def test_the_client_reads_only_the_answer_fields_it_declares() -> None:
    folder = Path(client_module.__file__).parent
    declared = {name.split(".")[-1] for names in wire_module.ANSWER_FIELDS.values() for name in names}
    read: dict[str, set[str]] = {}
    for name in CLIENT_MODULES[:-1]:  # program admission reads no answer but `/metrics`' text
        for node in ast.walk(ast.parse((folder / name).read_text())):
            key = _read_key(node)
            if key is not None and key not in declared | OWN_KEYS:
                read.setdefault(name, set()).add(key)
    assert read == {}, "declare each in wire.ANSWER_FIELDS (checked against the release) or OWN_KEYS"


def _read_key(node: ast.AST) -> str | None:
    """`x.get("k")` or a `x["k"]` load: "k"."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
            node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def test_the_fake_answers_only_fields_the_release_builds(api: SglangApi, tiny_path: Path) -> None:
    async def answers() -> dict[str, dict]:
        async with FakeSglangServer(tiny_path) as server, httpx.AsyncClient(base_url=server.url) as http:
            body = {"input_ids": list(range(3, 12)), "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
            stopped = {**body, "sampling_params": {"max_new_tokens": 40, "stop_token_ids": list(range(100, 900))}}
            return {"generate": (await http.post("/generate", json=body)).json(),
                    "stopped": (await http.post("/generate", json=stopped)).json(),
                    "server_info": (await http.get("/server_info")).json(),
                    "model_info": (await http.get("/model_info")).json()}

    got = asyncio.run(answers())
    assert got["stopped"]["meta_info"]["finish_reason"]["type"] == "stop", "a stop reason was answered"
    extra = {"meta_info": set(got["generate"]["meta_info"]) - api.answers["meta_info"],
             "generate": set(got["generate"]) - api.answers["meta_info"] - {"text"},
             "finish_reason": (set(got["generate"]["meta_info"]["finish_reason"])
                               | set(got["stopped"]["meta_info"]["finish_reason"])) - api.answers["finish_reason"],
             "server_info": set(got["server_info"]) - api.answers["GET /server_info"],
             "model_info": set(got["model_info"]) - api.answers["GET /model_info"]}
    assert {k: v for k, v in extra.items() if v} == {}
