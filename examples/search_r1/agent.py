"""`experiment=search_r1`: one agent that searches through a tool call and answers (the Search-R1 shape).

Each turn replays the whole history through the OpenAI SDK (`RELAX_BASE_URL`, `RELAX_API_KEY`, `max_retries=0`)
with one function tool, `search(query)`, answered from the run's retrieval service at `$SEARCH_URL` (started once
per run by `agent.services.retriever`). The session ends on a reply without a tool call (the final answer) or
after `SEARCH_MAX_TURNS` model calls (default 4). The reward is the exact match (normalized) of the answer,
`<answer>...</answer>` or the last line, against `metadata.answer`; metadata counts searches and turns. The
conversation is exported implicitly: `{"reward", "metadata"}` in RELAX_OUTPUT_JSON.

A random model is handled, not fatal: no tool call is a (wrong) final answer, bad tool arguments get a tool
message saying what to fix, and the gateway's 400 context_length_exceeded ends the session with reward 0.
"""

from __future__ import annotations

import json
import os

from openai import BadRequestError, OpenAI
from search_tools import TOOLS, exact_match, final_answer, is_context_error, run_tool_calls

MAX_TURNS = int(os.environ.get("SEARCH_MAX_TURNS", "4"))
SYSTEM = ("You answer questions about an encyclopedia of invented places, people and companies. Call the search "
          "tool to look facts up, as often as needed, then reply with the answer inside <answer></answer>.")


def converse(client: OpenAI, messages: list[dict]) -> dict:
    """Run the turns, appending to `messages`; returns counts and how the session ended."""
    searches, turns, ended = 0, 0, "answered"
    for turn in range(MAX_TURNS):
        try:
            response = client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=messages,
                                                      tools=TOOLS)
        except BadRequestError as error:
            if not is_context_error(error):
                raise
            ended = "context_length"
            break
        turns += 1
        message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            break
        if turn + 1 == MAX_TURNS:
            ended = "max_turns"
            break
        searches += len(calls)
        messages.extend(run_tool_calls(calls)[0])
    return {"searches": searches, "turns": turns, "ended": ended}


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, *task["messages"]]
    counts = converse(client, messages)
    last = messages[-1]
    answer = final_answer(last.get("content")) if counts["ended"] == "answered" and last["role"] == "assistant" else ""
    reward = exact_match(answer, str(task["metadata"]["answer"]))
    metadata = {"searches": counts["searches"], "turns": counts["turns"], "answered": float(bool(answer)),
                "ended": counts["ended"], "prediction": answer[:200]}
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": metadata}, f)


if __name__ == "__main__":
    main()
