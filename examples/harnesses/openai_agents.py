"""The OpenAI Agents SDK (openai-agents) with one `bash` function tool, configured only from the environment.

`OPENAI_BASE_URL`/`OPENAI_API_KEY` (set by the agent contract) reach `AsyncOpenAI()`, the model name is
`RELAX_MODEL`, tracing is off through `OPENAI_AGENTS_DISABLE_TRACING=1` (the preset sets it: with tracing on
the SDK exports traces to api.openai.com). `OPENAI_AGENTS_API=chat|responses` picks
`OpenAIChatCompletionsModel` or `OpenAIResponsesModel`; `OPENAI_AGENTS_STREAM=1` runs `Runner.run_streamed`.
The conversation is exported implicitly (no output file).
"""

from __future__ import annotations

import asyncio
import os

from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from common import flag, shell, task_prompt
from openai import AsyncOpenAI


@function_tool
def bash(command: str) -> str:
    """Run a bash command and return its output.

    Args:
        command: the command line to run.
    """
    return shell(command)


def model() -> OpenAIChatCompletionsModel | OpenAIResponsesModel:
    client = AsyncOpenAI(max_retries=0)
    api = os.environ.get("OPENAI_AGENTS_API", "chat")
    if api == "responses":
        return OpenAIResponsesModel(model=os.environ["RELAX_MODEL"], openai_client=client)
    if api == "chat":
        return OpenAIChatCompletionsModel(model=os.environ["RELAX_MODEL"], openai_client=client)
    raise SystemExit(f"OPENAI_AGENTS_API={api!r}: use chat or responses")


async def main() -> None:
    agent = Agent(name="assistant", instructions="Solve the task. Use the bash tool to compute.", tools=[bash],
                  model=model())
    if flag("OPENAI_AGENTS_STREAM"):
        result = Runner.run_streamed(agent, task_prompt(), max_turns=8)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, task_prompt(), max_turns=8)
    print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
