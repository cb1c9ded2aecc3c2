"""`experiment=search_r1_multi`: a main agent delegates to searcher sub-agents, each with its own model context.

The plan is fixed, so even an untrained model exercises every part: `SEARCH_SEARCHERS` searchers (default 2) run
at once, each its own conversation (its own messages, its own calls to the same endpoint) with the `search` tool
and a different angle on the question, for up to `SEARCH_SEARCHER_TURNS` model calls (default 3). Each one's
report is the documents it retrieved plus its last reply. The main agent then gets the question and every report
in one conversation of its own (no tools) and answers, `<answer>...</answer>` or its last line.

Export, JSONL in RELAX_OUTPUT_JSON (docs/design.md §3.2), one record per context, each exactly the messages
sent plus the final assistant reply (so they match the recorded turns):
`{"name": "main", "messages", "reward": outcome, "metadata": {"outcome", ...}}` where outcome is the exact match
(normalized) against `metadata.answer`, and `{"name": "searcher_<i>", "messages", "tools", "metadata":
{"usefulness", "searches"}}` where usefulness is 1.0 when the main agent's (non-empty) answer appears in that
searcher's report, else 0.0. `credit=custom_advantage` with `relax_pipeline.credit.examples.outcome_times_usefulness`
gives main its outcome and every searcher outcome × usefulness (before group normalization by the hook's caller).

A random model is handled: no tool call ends a searcher, bad arguments get a tool message saying what to fix, and a
400 context_length_exceeded ends that context (a context without any reply is not exported; without a main
reply the session has no outcome and its group is filtered by the hook).
"""

from __future__ import annotations

import asyncio
import json
import os

from openai import AsyncOpenAI, BadRequestError
from search_tools import TOOLS, exact_match, final_answer, is_context_error, normalize, run_tool_calls

SEARCHERS = int(os.environ.get("SEARCH_SEARCHERS", "2"))
SEARCHER_TURNS = int(os.environ.get("SEARCH_SEARCHER_TURNS", "3"))
REPORT_CHARS = int(os.environ.get("SEARCH_REPORT_CHARS", "1200"))
ANGLES = ("Search for the entity the question names.", "Search for the fact the question asks about, in other words.",
          "Search for anything the answer depends on.")
SEARCHER_SYSTEM = ("You are a searcher. Call the search tool to find documents that answer the question, then reply "
                   "with a one-line summary of what you found.")
MAIN_SYSTEM = ("You answer questions about an encyclopedia of invented places, people and companies, using the "
               "reports of your searchers. Reply with the answer inside <answer></answer>.")


async def call(client: AsyncOpenAI, messages: list[dict], tools: list[dict] | None) -> dict | None:
    """One model call; the assistant message, or None when the conversation no longer fits the context."""
    extra = {"tools": tools} if tools else {}
    try:
        response = await client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=messages, **extra)
    except BadRequestError as error:
        if is_context_error(error):
            return None
        raise
    return response.choices[0].message.model_dump(exclude_none=True)


async def searcher(client: AsyncOpenAI, index: int, question: str) -> dict:
    """One searcher's conversation: `{"messages", "found", "searches"}` (messages end with its last reply)."""
    angle = ANGLES[index % len(ANGLES)]
    messages = [{"role": "system", "content": SEARCHER_SYSTEM},
                {"role": "user", "content": f"Question: {question}\n{angle}"}]
    found, searches = [], 0
    for turn in range(SEARCHER_TURNS):
        message = await call(client, messages, TOOLS)
        if message is None:
            break
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls or turn + 1 == SEARCHER_TURNS:
            break
        tool_messages, text = await asyncio.to_thread(run_tool_calls, calls)
        messages.extend(tool_messages)
        found.append(text)
        searches += len(calls)
    return {"messages": sent_and_replied(messages), "found": "\n".join(t for t in found if t), "searches": searches}


def sent_and_replied(messages: list[dict]) -> list[dict]:
    """`messages` up to its last assistant reply (tool results after it were never sent); [] without one."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return messages[:last + 1]


def report(index: int, context: dict) -> str:
    """What the main agent reads from one searcher: its documents and its last reply, cut to REPORT_CHARS."""
    replies = [m.get("content") or "" for m in context["messages"] if m["role"] == "assistant"]
    text = f"{context['found'] or 'no documents'}\nSummary: {(replies[-1] if replies else '').strip()}"
    return f"[searcher {index}]\n{text[:REPORT_CHARS]}"


def records(task: dict, main: list[dict], contexts: list[dict], reports: list[str]) -> list[dict]:
    """The export: main (when it replied) and every searcher that replied."""
    answer = final_answer(main[-1].get("content")) if main else ""
    outcome = exact_match(answer, str(task["metadata"]["answer"]))
    out = []
    if main:
        out.append({"name": "main", "messages": main, "reward": outcome,
                    "metadata": {"outcome": outcome, "answered": float(bool(answer)), "prediction": answer[:200]}})
    for i, (context, text) in enumerate(zip(contexts, reports, strict=True)):
        if context["messages"]:
            useful = float(bool(normalize(answer)) and normalize(answer) in normalize(text))
            out.append({"name": f"searcher_{i}", "messages": context["messages"], "tools": TOOLS,
                        "metadata": {"usefulness": useful, "searches": context["searches"]}})
    return out


async def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = AsyncOpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
    question = task["metadata"]["question"]
    contexts = await asyncio.gather(*(searcher(client, i, question) for i in range(SEARCHERS)))
    reports = [report(i, c) for i, c in enumerate(contexts)]
    prompt = task["messages"][-1]["content"] + "\n\nReports from your searchers:\n" + "\n\n".join(reports)
    main_messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": prompt}]
    reply = await call(client, main_messages, None)
    main_context = [*main_messages, reply] if reply is not None else []
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records(task, main_context, contexts, reports))


if __name__ == "__main__":
    asyncio.run(main())
