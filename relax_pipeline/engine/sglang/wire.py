"""The `/generate` wire of `engine=sglang`: the request body, the answer as a `GenerateResult`, and stop strings
split by an abort.

`payload` builds the body (token ids in, never text; logprobs of the output tokens out; `session_params` and only the
new ids for a turn of an SGLang session; `image_data`, the prompt's image URLs, `sglang/media.py`; `cache_salt`,
the loaded weight version's cache namespace, `cache_salt`). `parse_generate`
reads `meta_info.output_token_logprobs` (`[logprob, token_id, text]` per token; `output_ids` must agree),
`finish_reason` (`stop` with `matched`, `length`, `abort`), `weight_version`, and `weight_versions` (the spans of a
generation paused across weight updates: every token keeps the version that sampled it). `stopped_across` cuts a
resumed generation's result after a stop string that began in its `stop_context` (SGLang matches stop strings in a
request's own output only).

What it does not do: HTTP (`client.py` sends the body), sessions' bookkeeping (`sessions.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from relax_pipeline.engine.base import GenerateResult, SamplingParams, varying
from relax_pipeline.engine.sampling import StopStringMatcher
from relax_pipeline.engine.sglang.sessions import SessionRequest

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
"""SGLang's `finish_reason.type` → ours."""
ANSWER_FIELDS: dict[str, frozenset[str]] = {
    "POST /generate": frozenset({"output_ids", "meta_info", "meta_info.output_token_logprobs",
                                 "meta_info.finish_reason", "meta_info.finish_reason.type",
                                 "meta_info.finish_reason.matched", "meta_info.weight_version",
                                 "meta_info.weight_versions", "meta_info.weight_versions.version",
                                 "meta_info.weight_versions.start", "meta_info.weight_versions.end",
                                 "meta_info.prompt_tokens", "meta_info.cached_tokens"}),
    "GET /server_info": frozenset({"max_total_num_tokens", "tp_size", "version", "enable_session_radix_cache"}),
    "GET /model_info": frozenset({"is_generation", "model_path"}),
    "POST /update_weights_from_disk": frozenset({"success", "message"}),
    "POST /update_weights_from_tensor": frozenset({"success", "message"}),
    "POST /update_weights_from_distributed": frozenset({"success", "message"}),
    "POST /init_weights_update_group": frozenset({"success", "message"}),
    "POST /begin_weight_update": frozenset({"success", "message"}),
    "POST /end_weight_update": frozenset({"success", "message"}),
    "GET /metrics": frozenset({"sglang:num_used_tokens"})}
"""Every field of SGLang's answers this client reads, by route (dotted: inside an object; `GET /metrics`: Prometheus
series). `tests/integration/test_sglang_conformance.py` checks each against the release's source and that the
client's modules read nothing else of an answer."""


class SglangError(RuntimeError):
    """An SGLang server or the router answered something the client cannot use; the message names the URL."""


def cache_salt(version: int) -> str:
    """The `cache_salt` of every `/generate` sent while weights `version` are loaded: SGLang matches a prompt's
    prefix only against KV cached under the same salt (`mem_cache/radix_cache.py`, `RadixKey`), so a request sent
    after an update never reuses KV that older weights computed."""
    return f"relax-w{version}"


def payload(prompt: list[int], sampling: SamplingParams, limit: int, rid: str,
            session: SessionRequest | None = None, image_data: list[str] | None = None,
            salt: str | None = None) -> dict[str, Any]:
    """The /generate body (token ids in, logprobs of the output tokens out); a session turn sends only the ids
    its session does not hold, with its `session_params`; a prompt with images sends them as `image_data` (one
    URL per unexpanded placeholder token, in order); `salt`: the weight version's `cache_salt`."""
    params: dict[str, Any] = {"max_new_tokens": limit, "temperature": sampling.temperature, "top_p": sampling.top_p,
                              "top_k": sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids),
                              "no_stop_trim": True, "skip_special_tokens": False}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1,
            "rid": rid, "stream": False}
    if session is not None:
        body |= {"input_ids": session.input_ids, "session_params": session.params}
    if image_data:
        body["image_data"] = image_data
    if salt is not None:
        body["cache_salt"] = salt
    return body


def stopped_across(tokenizer: Any, sampling: SamplingParams, result: GenerateResult) -> GenerateResult:
    """`result` cut after the first stop string that starts in `sampling.stop_context` (a resumed generation's
    earlier output) and ends in `result`'s tokens, finish "stop": SGLang matches stop strings in a request's own
    output only. The tokens SGLang generated past it are dropped (a session's node still holds them)."""
    if not sampling.stop or not sampling.stop_context or not result.output_ids:
        return result
    matcher = StopStringMatcher(tokenizer, sampling.stop)
    matcher.prime(sampling.stop_context)
    for i, token in enumerate(result.output_ids):
        hit = matcher.push(token)
        if hit is not None:
            if i + 1 == len(result.output_ids) and result.finish_reason == "stop":
                return result  # SGLang stopped there itself
            return replace(result, output_ids=result.output_ids[:i + 1], logprobs=result.logprobs[:i + 1],
                           finish_reason="stop", matched_stop=hit,
                           weight_versions=varying(result.token_versions[:i + 1]))
    return result


def parse_generate(body: dict[str, Any], version: int, url: str = "") -> GenerateResult:
    """A `/generate` answer as a `GenerateResult`; `version` when the server reports none that is a number."""
    meta = body.get("meta_info") or {}
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise SglangError(f"SGLang server {url}: /generate answered without meta_info.output_token_logprobs "
                          "(the client asks for return_logprob=true)")
    ids = tuple(int(p[1]) for p in pairs)
    if "output_ids" in body and tuple(body["output_ids"]) != ids:
        raise SglangError(f"SGLang server {url}: output_ids and output_token_logprobs disagree")
    reason = meta.get("finish_reason") or {"type": "abort"}
    finish = FINISH.get(reason.get("type"))
    if finish is None:
        raise SglangError(f"SGLang server {url}: unknown finish_reason {reason!r}")
    matched = reason.get("matched") if finish == "stop" else None
    served = _version(meta.get("weight_version"), version)
    versions = token_versions(meta.get("weight_versions"), len(ids), served)
    return GenerateResult(ids, tuple(float(p[0]) for p in pairs), finish,  # type: ignore[arg-type]
                          versions[-1] if versions else served, matched, varying(versions))


def token_versions(spans: list[dict[str, Any]] | None, n: int, version: int) -> tuple[int, ...]:
    """The version of each of `n` output tokens from `meta_info.weight_versions` (`[{version, start, end}]`, spans
    of a generation paused across weight updates); all `version` without spans."""
    out = [version] * n
    for span in spans or ():
        served = _version(span.get("version"), version)
        for i in range(max(int(span.get("start", 0)), 0), min(int(span.get("end", 0)), n)):
            out[i] = served
    return tuple(out)


def _version(served: object, fallback: int) -> int:
    """A weight version SGLang reports (a string; "default", the launch weights, is our version 0) as ours;
    `fallback` when it is neither."""
    text = str(served if served is not None else "")
    return int(text) if text.isdigit() else 0 if text == "default" else fallback
