"""Hugging Face smolagents: a `ToolCallingAgent` on an `OpenAIModel`, with one `bash` tool.

Configured only from the environment: `OPENAI_BASE_URL`/`OPENAI_API_KEY` (the agent contract) and the model
name `RELAX_MODEL`; `SMOLAGENTS_STREAM=1` streams the model's outputs. smolagents needs no offline switch.
The agent ends when the model calls its built-in `final_answer` tool. smolagents sends `stop` strings and
`tool_choice: required`, and replays earlier tool calls as assistant text and results as user
"Observation:" messages (HARNESSES.md). The conversation is exported implicitly (no output file).
"""

from __future__ import annotations

import os

from common import flag, shell, task_prompt
from smolagents import OpenAIModel, ToolCallingAgent, tool


@tool
def bash(command: str) -> str:
    """Run a bash command and return its output.

    Args:
        command: the command line to run.
    """
    return shell(command)


def main() -> None:
    model = OpenAIModel(model_id=os.environ["RELAX_MODEL"], api_base=os.environ["OPENAI_BASE_URL"],
                        api_key=os.environ["OPENAI_API_KEY"], client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[bash], model=model, max_steps=6, stream_outputs=flag("SMOLAGENTS_STREAM"))
    print(agent.run(task_prompt()))


if __name__ == "__main__":
    main()
