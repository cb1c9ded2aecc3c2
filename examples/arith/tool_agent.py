"""`agent=arith_tool`: the arith task with a calculator tool, over two or more model calls.

Each turn replays the whole history through the OpenAI SDK with one function tool, `calculator`
(`{"expression": "12 + 34"}`: two integers and `+`, `-` or `*`, parsed by hand, never evaluated as code).
Tool calls get tool messages with the results; a reply without a call, before the tool was used, gets one
user message asking to check it with the calculator, so every session makes at least two calls. The
session ends on a reply without a call after that, or after `ARITH_MAX_TURNS` calls (default 4). The reward
is the exact answer of the last reply (`relax_pipeline.credit.examples.answer_reward`); metadata counts the
tool calls. The conversation is exported implicitly.
"""

import json
import os
import re

from openai import OpenAI

from relax_pipeline.credit.examples import answer_reward

MAX_TURNS = int(os.environ.get("ARITH_MAX_TURNS", "4"))
CHECK = "Check it with the calculator tool, then answer with just the number."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Compute a + b, a - b or a * b for two integers a and b.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12 + 34"}},
                   "required": ["expression"]},
}}]
_EXPRESSION = re.compile(r"\s*(-?\d+)\s*([+\-*x×])\s*(-?\d+)\s*=?\s*")


def calculate(expression: str) -> str:
    """The value of `a op b`, or an error naming the accepted form."""
    match = _EXPRESSION.fullmatch(expression)
    if not match:
        return "error: write two integers and +, - or *, e.g. 12 + 34"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def tool_results(calls: list[dict]) -> list[dict]:
    """One tool message per call, in order."""
    out = []
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:
            args = {}
        expression = str(args.get("expression", "")) if isinstance(args, dict) else ""
        out.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(expression)})
    return out


def converse(client: OpenAI, messages: list[dict]) -> int:
    """Run the turns, appending to `messages`; returns the number of tool calls the model made."""
    calls_made, asked = 0, False
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=messages, tools=TOOLS)
        message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if calls:
            calls_made += len(calls)
            messages.extend(tool_results(calls))
        elif not calls_made and not asked:
            asked = True
            messages.append({"role": "user", "content": CHECK})
        else:
            break
    return calls_made


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
    messages = list(task["messages"])
    calls_made = converse(client, messages)
    final = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    reward = answer_reward(final, task["metadata"]["answer"])
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"tool_calls": calls_made}}, f)


if __name__ == "__main__":
    main()
