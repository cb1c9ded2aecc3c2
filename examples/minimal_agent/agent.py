"""The minimal relax_pipeline agent: one model call through the OpenAI SDK, exported implicitly.

The pipeline starts this once per session with RELAX_INPUT_JSON, RELAX_BASE_URL and RELAX_API_KEY
set (docs/design.md §3.2). It asks the model once, appends the assistant message (`model_dump()`) and writes
only a reward: the recorded conversation itself is the implicit export.
"""

import asyncio
import json
import os

from openai import AsyncOpenAI


async def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = AsyncOpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"])
    messages = task["messages"]
    response = await client.chat.completions.create(model="policy", messages=messages)
    messages.append(response.choices[0].message.model_dump())
    answer = str(task.get("metadata", {}).get("answer", ""))
    reward = 1.0 if answer and answer in (messages[-1].get("content") or "") else 0.0
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward}, f)


if __name__ == "__main__":
    asyncio.run(main())
