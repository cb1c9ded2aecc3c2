"""A multi-turn agent: model → fake tool → model for a few turns, then the final conversation is exported.

Each turn replays the whole history through the OpenAI SDK. When the model calls the `calculator`
tool, the agent answers with a tool message; otherwise it sends the tool's hint as a user message.
The final conversation is written as one explicit record with a reward: 1 when the last answer
contains the expected number, else 0. Arithmetic is parsed by hand, never evaluated as code.
"""

import asyncio
import json
import os
import re

from openai import AsyncOpenAI

TURNS = int(os.environ.get("MINIMAL_AGENT_TURNS", "3"))
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Add or subtract two integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]


def calculate(expression: str) -> str:
    match = re.fullmatch(r"\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*", expression)
    if not match:
        return "error: write 'a + b' or 'a - b'"
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b)


def observe(message: dict, question: str) -> list[dict]:
    """Tool messages for the model's calls, or a user hint when it made none."""
    calls = message.get("tool_calls") or []
    if not calls:
        expression = re.sub(r"[^0-9+\- ]", "", question).strip()
        return [{"role": "user", "content": f"calculator({expression!r}) = {calculate(expression)}. Answer."}]
    out = []
    for call in calls:
        args = json.loads(call["function"]["arguments"] or "{}")
        out.append({"role": "tool", "tool_call_id": call["id"], "content": calculate(str(args.get("expression", "")))})
    return out


async def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = AsyncOpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"],
                         max_retries=0)
    messages = list(task["messages"])
    question = messages[-1]["content"]
    for turn in range(TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message.model_dump()
        messages.append(message)
        if turn + 1 < TURNS:
            messages.extend(observe(message, question))
    answer = str(task.get("metadata", {}).get("answer", ""))
    final = messages[-1].get("content") or ""
    reward = 1.0 if answer and re.search(rf"(?<!\d){re.escape(answer)}(?!\d)", final) else 0.0
    record = {"name": "main", "messages": messages, "tools": TOOLS, "reward": reward,
              "metadata": {"turns": TURNS}}
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
