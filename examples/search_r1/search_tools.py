"""What the search_r1 agents share: the `search` tool, the retriever client, answer extraction and the reward.

`TOOLS` is the OpenAI function-tool definition of `search(query)`. `run_tool_calls` turns an assistant message's
tool calls into tool messages (results from the retrieval service at `$SEARCH_URL`, `POST /retrieve`); arguments a
random model writes badly (not JSON, no `query`, another tool name) get a tool message saying what to fix, never an
exception. `final_answer` reads `<answer>...</answer>` (else the last non-empty line) and `exact_match` compares it
to the gold answer after SQuAD-style normalization (lowercase, no punctuation, no articles, single spaces), as
Search-R1 scores it. `is_context_error` recognizes the gateway's 400 `context_length_exceeded`.

Not done here: ranking or caching; the retriever (`retriever.py`) owns the index.
"""

from __future__ import annotations

import json
import os
import re
import string
import urllib.request

TOPK = int(os.environ.get("SEARCH_TOPK", "3"))
TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the encyclopedia. Returns the most relevant short documents.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]},
}}]
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def search(query: str, topk: int = TOPK) -> list[dict]:
    """The retriever's results for `query`: `[{"id", "title", "text", "score"}]`."""
    url = os.environ["SEARCH_URL"].rstrip("/") + "/retrieve"
    body = json.dumps({"query": query, "topk": topk}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["results"]


def format_results(results: list[dict]) -> str:
    """Results as the model reads them, one document a line."""
    if not results:
        return "No documents found. Try other words."
    return "\n".join(f"Doc {i + 1} ({r['title']}): {r['text']}" for i, r in enumerate(results))


def tool_message(call: dict) -> tuple[dict, str]:
    """The tool message answering one call, and the text of the documents it returned ('' on a bad call)."""
    function = call.get("function") or {}
    try:
        args = json.loads(function.get("arguments") or "{}")
    except ValueError:
        args = None
    query = args.get("query") if isinstance(args, dict) else None
    if function.get("name") != "search" or not isinstance(query, str) or not query.strip():
        content, found = 'error: call search with JSON arguments {"query": "words to look up"}', ""
    else:
        found = format_results(search(query))
        content = found
    return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}, found


def run_tool_calls(calls: list[dict]) -> tuple[list[dict], str]:
    """Tool messages for every call, in order, and all retrieved text joined."""
    answered = [tool_message(call) for call in calls]
    return [m for m, _ in answered], "\n".join(found for _, found in answered if found)


def final_answer(text: str | None) -> str:
    """The text inside the last `<answer>` tags, else the last non-empty line."""
    text = text or ""
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalized prediction equals the normalized gold answer, else 0.0."""
    return float(bool(normalize(gold)) and normalize(prediction) == normalize(gold))


def is_context_error(error: Exception) -> bool:
    """True for the gateway's 400 context_length_exceeded (the conversation no longer fits)."""
    return getattr(error, "code", None) == "context_length_exceeded" or "context_length_exceeded" in str(error)
