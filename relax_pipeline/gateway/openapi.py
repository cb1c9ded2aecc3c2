"""The gateway's OpenAPI 3.0 document, written as data: request bodies typed per protocol, errors per provider.

The model routes are raw ASGI (`app.py`'s `TurnRoute`), so FastAPI cannot derive their schemas; this module states them
once, for the front-ends a gateway serves: OpenAI Chat Completions (`chat/completions`), OpenAI Responses
(`responses`), Anthropic Messages (`messages`, `messages/count_tokens`) and `models`, each under
`{prefix}/v1/`. `openapi_document` is served at `GET {prefix}/openapi.json` without a credential and is what
the fuzz tier (`tests/fuzz`, schemathesis) generates requests from.

The request schemas describe what the gateway reads (docs/design.md §3.3): the fields it uses, typed; every other
field is allowed (`additionalProperties`), since real harnesses send many. Response schemas are loose for
200 (the SDKs validate those) and exact for errors: the OpenAI shape `{"error": {"message", "type", "param",
"code"}}` on OpenAI routes and the Anthropic shape `{"type": "error", "error": {"type", "message"}}` on
Messages routes. This module does not validate requests (the front-ends do) and routes nothing (`app.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Schema = dict[str, Any]

STRING: Schema = {"type": "string"}
TEXT: Schema = {"type": "string", "minLength": 1}
POSITIVE: Schema = {"type": "integer", "minimum": 1}
OBJECT: Schema = {"type": "object"}
TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"type": "string", "enum": ["text"]}, "text": TEXT}}
CONTENT: Schema = {"oneOf": [TEXT, {"type": "array", "minItems": 1, "items": TEXT_PART}]}
FUNCTION: Schema = {"type": "object", "required": ["name"],
                    "properties": {"name": TEXT, "description": STRING, "parameters": OBJECT}}
CHAT_TOOL: Schema = {"type": "object", "required": ["type", "function"],
                     "properties": {"type": {"type": "string", "enum": ["function"]}, "function": FUNCTION}}
TOOL_CALL: Schema = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": TEXT, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": TEXT, "arguments": STRING}}}}
CHAT_MESSAGE: Schema = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": CONTENT,
    "tool_calls": {"type": "array", "items": TOOL_CALL},
    "tool_call_id": STRING, "name": STRING}}
STOP: Schema = {"oneOf": [STRING, {"type": "array", "items": STRING}], "nullable": True}

CHAT_REQUEST: Schema = {"type": "object", "required": ["messages"], "properties": {
    "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
    "tools": {"type": "array", "items": CHAT_TOOL}, "chat_template_kwargs": OBJECT,
    "max_tokens": POSITIVE, "max_completion_tokens": POSITIVE, "stop": STOP, "seed": {"type": "integer"},
    "stream": {"type": "boolean"}, "n": {"type": "integer", "enum": [1]}}}

RESPONSES_ITEM: Schema = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [STRING, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": TEXT}}}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"type": "string", "enum": ["function_call"]}, "call_id": TEXT, "name": TEXT,
        "arguments": STRING}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"type": "string", "enum": ["function_call_output"]}, "call_id": TEXT, "output": STRING}}]}
RESPONSES_REQUEST: Schema = {"type": "object", "required": ["input"], "properties": {
    "instructions": {"type": "string", "nullable": True},
    "input": {"oneOf": [TEXT, {"type": "array", "minItems": 1, "items": RESPONSES_ITEM}]},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "name": TEXT, "description": STRING,
        "parameters": OBJECT}}},
    "max_output_tokens": POSITIVE, "previous_response_id": {"type": "string", "nullable": True},
    "chat_template_kwargs": OBJECT, "stream": {"type": "boolean"}}}

ANTHROPIC_BLOCK: Schema = {"oneOf": [
    {"type": "object", "required": ["type", "text"],
     "properties": {"type": {"type": "string", "enum": ["text"]}, "text": TEXT}},
    {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"type": "string", "enum": ["tool_use"]}, "id": TEXT, "name": TEXT, "input": OBJECT}},
    {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"type": "string", "enum": ["tool_result"]}, "tool_use_id": TEXT,
        "content": {"oneOf": [STRING, {"type": "array", "items": TEXT_PART}]}, "is_error": {"type": "boolean"}}}]}
ANTHROPIC_MESSAGE: Schema = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["user", "assistant"]},
    "content": {"oneOf": [TEXT, {"type": "array", "minItems": 1, "items": ANTHROPIC_BLOCK}]}}}
ANTHROPIC_FIELDS: Schema = {
    "system": {"oneOf": [STRING, {"type": "array", "items": TEXT_PART}]},
    "messages": {"type": "array", "minItems": 1, "items": ANTHROPIC_MESSAGE},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": TEXT, "description": STRING, "input_schema": OBJECT}}},
    "chat_template_kwargs": OBJECT}
MESSAGES_REQUEST: Schema = {"type": "object", "required": ["max_tokens", "messages"], "properties": {
    **ANTHROPIC_FIELDS, "max_tokens": POSITIVE, "stop_sequences": {"type": "array", "items": STRING},
    "stream": {"type": "boolean"}}}
COUNT_TOKENS_REQUEST: Schema = {"type": "object", "required": ["messages"], "properties": ANTHROPIC_FIELDS}

SSE_EVENT: Schema = {"type": "object", "required": ["data"], "properties": {"data": STRING, "event": STRING}}
"""One Buffered SSE event as schemathesis reads it (`event:` name, `data:` payload)."""
OPENAI_ERROR: Schema = {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {
    "error": {"type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
              "properties": {"message": {"type": "string", "minLength": 1}, "type": STRING,
                             "param": {"type": "string", "nullable": True},
                             "code": {"type": "string", "nullable": True}}}}}
ANTHROPIC_ERROR: Schema = {"type": "object", "required": ["type", "error"], "additionalProperties": False,
                           "properties": {"type": {"type": "string", "enum": ["error"]}, "error": {
                               "type": "object", "required": ["type", "message"], "additionalProperties": False,
                               "properties": {"type": STRING, "message": {"type": "string", "minLength": 1}}}}}
ERROR_STATUSES = {"400": "invalid request; `param` (OpenAI) or the message's `field: ` prefix (Anthropic) names "
                         "the field", "401": "missing or unknown credential (send RELAX_API_KEY)",
                  "404": "the session is not running (finished, failed or dropped)",
                  "499": "the client disconnected; nothing was committed"}

OPERATIONS: dict[str, tuple[str, Schema, str]] = {
    "chat/completions": ("chat", CHAT_REQUEST, "openai"),
    "responses": ("responses", RESPONSES_REQUEST, "openai"),
    "messages": ("messages", MESSAGES_REQUEST, "anthropic"),
    "messages/count_tokens": ("messages", COUNT_TOKENS_REQUEST, "anthropic"),
}
"""Resource → (the front-end that serves it, its request body schema, its error shape)."""


def openapi_document(prefix: str, apis: Sequence[str], title: str = "relax_pipeline gateway") -> dict[str, Any]:
    """The OpenAPI 3.0.3 document of the routes a gateway with front-ends `apis` serves under `prefix`."""
    paths: dict[str, Any] = {f"{prefix}/v1/{resource}": {"post": _operation(resource, body, shape)}
                             for resource, (api, body, shape) in OPERATIONS.items() if api in apis}
    paths[f"{prefix}/v1/models"] = {"get": {
        "operationId": "models", "security": _SECURITY,
        "responses": {"200": _json({"type": "object", "required": ["object", "data"]}),
                      **{status: _json(OPENAI_ERROR, why) for status, why in ERROR_STATUSES.items()
                         if status in ("401", "404")}}}}
    return {"openapi": "3.0.3", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                               "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}}}


_SECURITY = [{"bearer": []}, {"apiKey": []}]


def _operation(resource: str, body: Schema, shape: str) -> dict[str, Any]:
    error = OPENAI_ERROR if shape == "openai" else ANTHROPIC_ERROR
    return {"operationId": resource.replace("/", "_"), "security": _SECURITY,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _null_is_absent(body)}}},
            "responses": {"200": {"description": "the model's answer (JSON, or Buffered SSE when stream=true)",
                                  "content": {"application/json": {"schema": OBJECT},
                                              "text/event-stream": {"schema": SSE_EVENT}}},
                          **{status: _json(error, why) for status, why in ERROR_STATUSES.items()}}}


def _json(schema: Schema, description: str = "JSON") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _null_is_absent(schema: Any) -> Any:
    """The schema with every optional top-level field nullable: the gateway reads `null` as "not sent"."""
    required = set(schema.get("required", ()))
    properties = {name: field if name in required else {**field, "nullable": True}
                  for name, field in schema["properties"].items()}
    return {**schema, "properties": properties}
