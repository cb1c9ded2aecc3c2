"""OpenAI Chat Completions front-end: request JSON → `TurnRequest`, `TurnResult` → response JSON.

Fields used: `messages`, `tools`, `chat_template_kwargs`, `max_completion_tokens` and the legacy
`max_tokens` (the newer wins), `stop`, `seed`, `logprobs`; `model` is echoed. `temperature` and
`top_p` are ignored (the training config rules) and every other field is accepted and ignored, since
SDKs send many. `tool_choice`, `parallel_tool_calls` and `response_format` are not enforced.
Roles are system/user/assistant/tool; `developer` (OpenAI's newer name for it) is read as `system`. User and tool
contents may hold `image_url` parts (a data URI or an http(s) URL); whether the model accepts them is
the turn service's decision (a text-only model answers 400).

Messages are parsed by `canonical/form.py`, which explicit exports share. `stream=true` gets Buffered
SSE: comment frames while generating, then one `chat.completion.chunk` carrying the whole message, its
`finish_reason` and the full `usage` (whatever `stream_options` says), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relax_pipeline.canonical.form import (
    CanonicalError,
    Context,
    canonical_template_kwargs,
    canonical_tools,
    parse_message,
)
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.protocol.base import Lineage, ProtocolError, SSEFrame, TurnMeta, openai_body
from relax_pipeline.turn.records import TurnRequest, TurnResult


def parse_request(body: Any, memo: RequestMemo | None = None) -> TurnRequest:
    """Validate a Chat Completions body; errors carry the field path in `param`.

    With the session's `memo`, the replayed prefix of the history is not canonicalized again.
    """
    if not isinstance(body, Mapping):
        raise CanonicalError("the request body must be a JSON object", None)
    memo = memo or RequestMemo(0)
    tools, kwargs = body.get("tools"), body.get("chat_template_kwargs")
    context = memo.context(("chat", tools, kwargs),
                           lambda: Context(canonical_tools(tools), canonical_template_kwargs(kwargs)))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise CanonicalError("messages must be a non-empty list", "messages")
    messages, hashes = memo.canonical(raw, context, parse_message)
    _one_choice(body.get("n"))
    return TurnRequest(messages, context, _max_tokens(body), _stop(body.get("stop")), _seed(body.get("seed")),
                       hashes)


def _one_choice(n: Any) -> None:
    """`n` other than 1 is refused: one request is one sampled turn of one session's history."""
    if n is not None and n != 1:
        raise CanonicalError(f"n={n!r} is not supported: each request returns one choice (one turn of this "
                             "session); send n separate requests", "n")


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CanonicalError(f"{key} must be a positive integer, got {value!r}", key)
        return value
    return None


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,) if raw else ()
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(s for s in raw if s)
    raise CanonicalError("stop must be a string or a list of strings", "stop")


def _seed(raw: Any) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise CanonicalError("seed must be an integer", "seed")
    return raw


class ChatFrontend:
    """OpenAI Chat Completions as a `Frontend`."""

    name = "chat"
    paths = ("chat/completions",)

    def parse(self, body: Any, memo: RequestMemo, lineage: Lineage | None = None) -> TurnRequest:
        return parse_request(body, memo)

    def render(self, result: TurnResult, meta: TurnMeta) -> dict[str, Any]:
        return _completion(result, meta, "chat.completion", {"message": _message(result)})

    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        return openai_body(error)

    def stream_open(self, meta: TurnMeta) -> list[SSEFrame]:
        return [SSEFrame("connected", comment=True)]

    def heartbeat(self) -> SSEFrame:
        return SSEFrame("ping", comment=True)

    def stream_result(self, result: TurnResult, meta: TurnMeta) -> list[SSEFrame]:
        delta = _message(result)
        if "tool_calls" in delta:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(delta["tool_calls"])]
        chunk = _completion(result, meta, "chat.completion.chunk", {"delta": delta})
        return [SSEFrame(chunk), SSEFrame("[DONE]")]

    def stream_error(self, error: ProtocolError, meta: TurnMeta) -> list[SSEFrame]:
        return [SSEFrame(openai_body(error)), SSEFrame("[DONE]")]


def _message(result: TurnResult) -> dict[str, Any]:
    message = result.message.to_openai()
    if not result.message.tool_calls:
        message.pop("tool_calls", None)
    return message


def _completion(result: TurnResult, meta: TurnMeta, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A `chat.completion` (or chunk) carrying one choice, its finish reason and the full usage."""
    choice = {"index": 0, **body, "finish_reason": result.finish_reason,
              "logprobs": _logprobs(result, meta.token_text) if meta.token_text else None}
    completion = len(result.output.output_ids)
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
             "total_tokens": result.prompt_tokens + completion}
    return {"id": meta.response_id, "object": kind, "created": meta.created, "model": meta.model,
            "choices": [choice], "usage": usage}


def _logprobs(result: TurnResult, token_text: Callable[[int], str]) -> dict[str, Any]:
    entries = [{"token": token_text(tid), "logprob": lp, "bytes": None, "top_logprobs": []}
               for tid, lp in zip(result.output.output_ids, result.output.logprobs, strict=True)]
    return {"content": entries, "refusal": None}
