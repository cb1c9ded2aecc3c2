"""`docs/reference/http-api.md`: the gateway's HTTP API, generated from its OpenAPI document.

The routes, their request bodies (every field the gateway reads, flattened to dotted paths: `messages[].role`,
an object variant of a `oneOf` labelled by its `type`), their responses and security come from
`gateway/openapi.py`'s `openapi_document`, built for every front-end (`protocol/suite.py`'s `SUPPORTED_APIS`)
under the default service prefix (the `ProtocolSuite` record's default). How the routes behave is `gateway/app.py`'s
docstring.

What it does not do: serve or validate anything; the live document is `GET {prefix}/openapi.json`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_pipeline.gateway import openapi
from relax_pipeline.protocol.suite import SUPPORTED_APIS, ProtocolSuite
from relax_pipeline.reference.markdown import code, generated_note, prose, table

PACKAGE = Path(__file__).resolve().parents[1]


def default_prefix() -> str:
    return next(f.default for f in dataclasses.fields(ProtocolSuite) if f.name == "service_prefix")


def type_of(schema: dict[str, Any]) -> str:
    """A schema in a few words: `string (not empty)`, `array of object`, `"a" | "b"`, `... or null`."""
    if "oneOf" in schema:
        text = " or ".join(dict.fromkeys(type_of(s) for s in schema["oneOf"]))
    elif "enum" in schema:
        text = " | ".join(json.dumps(e) for e in schema["enum"])
    elif schema.get("type") == "array":
        text = ("non-empty " if schema.get("minItems") else "") + "array of " + type_of(schema.get("items", {}))
    else:
        text = schema.get("type", "any")
        limits = [f"≥ {schema['minimum']}" for _ in [0] if "minimum" in schema]
        limits += ["not empty" for _ in [0] if schema.get("minLength")]
        text += f" ({', '.join(limits)})" if limits else ""
    return text + (" or null" if schema.get("nullable") else "")


def fields(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, str, bool]]:
    """(dotted path, type, required) of every property of an object schema, nested objects and lists included."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        yield here, type_of(prop), name in required
        yield from _inside(prop, here)


def _inside(prop: dict[str, Any], here: str) -> Iterator[tuple[str, str, bool]]:
    if prop.get("type") == "array":
        yield from _inside(prop.get("items", {}), here + "[]")
    for variant in prop.get("oneOf", ()):
        kind = variant.get("properties", {}).get("type", {}).get("enum")
        label = f"{here} ({'type=' + kind[0] if kind and len(kind) == 1 else 'object'})"
        if variant.get("properties"):
            yield from fields(variant, label)
        elif variant.get("type") == "array":
            yield from _inside(variant.get("items", {}), here + "[]")
    if prop.get("properties"):
        yield from fields(prop, here)


def _operation(path: str, method: str, spec: dict[str, Any]) -> str:
    out = [f"### `{method.upper()} {path}`\n", f"operationId `{spec['operationId']}`; credential: "
           + " or ".join(code(name) for entry in spec.get("security", []) for name in entry) + ".\n"]
    body = spec.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        out.append("Request body (JSON); fields not listed are accepted and ignored:\n")
        out.append(table(["field", "type", "required"],
                         [[code(name), code(kind), "yes" if need else ""] for name, kind, need in fields(body)]))
    rows = []
    for status, answer in spec["responses"].items():
        kinds = ", ".join(code(media) for media in answer.get("content", {}))
        rows.append([code(status), prose(answer.get("description", "")), kinds])
    out.append("Responses:\n")
    out.append(table(["status", "when", "content"], rows))
    return "\n".join(out)


def _errors() -> str:
    rows = [[code(name), code(kind)] for name, kind, _ in fields(openapi.OPENAI_ERROR)]
    anthropic = [[code(name), code(kind)] for name, kind, _ in fields(openapi.ANTHROPIC_ERROR)]
    return ("## Error bodies\n\nOpenAI routes (`chat/completions`, `responses`, `models`):\n\n"
            + table(["field", "type"], rows) + "\nAnthropic routes (`messages`, `messages/count_tokens`):\n\n"
            + table(["field", "type"], anthropic))


def _docstring(path: Path, paragraphs: slice = slice(1, None)) -> str:
    """A module's docstring past its summary line (`paragraphs` of it), as Markdown paragraphs."""
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    return "\n\n".join(prose(p) for p in text.split("\n\n")[paragraphs]) + "\n"


def render() -> str:
    prefix = default_prefix()
    document = openapi.openapi_document(prefix, SUPPORTED_APIS)
    schemes = document["components"]["securitySchemes"]
    auth = table(["scheme", "how"], [[code(name), prose(", ".join(f"{k}: {v}" for k, v in s.items()))]
                                      for name, s in schemes.items()])
    parts = ["# HTTP API\n", generated_note("the gateway's OpenAPI document (`relax_pipeline/gateway/openapi.py`)"),
             f"The gateway serves every session's model API under the service prefix (`protocol.service_prefix`, "
             f"default `{prefix}`); an agent's `RELAX_BASE_URL` is `http://HOST:PORT{prefix}/`. This page is the "
             f"OpenAPI {document['openapi']} document of a gateway serving every front-end "
             f"(`protocol.apis={list(SUPPORTED_APIS)}`); the live one is `GET {prefix}/openapi.json`.\n",
             "## Credentials\n", auth, "## Routes\n"]
    for path, methods in document["paths"].items():
        for method, spec in methods.items():
            parts.append(_operation(path, method, spec))
    parts += [_errors(), "## How the routes behave\n", "From `relax_pipeline/gateway/app.py`:\n",
              _docstring(PACKAGE / "gateway" / "app.py", slice(1, 3)), "## What the schemas promise\n",
              "From `relax_pipeline/gateway/openapi.py`:\n", _docstring(PACKAGE / "gateway" / "openapi.py")]
    return "\n".join(parts)
