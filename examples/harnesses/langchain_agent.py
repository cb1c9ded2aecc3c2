"""LangChain: `langchain.agents.create_agent` with one `bash` tool on ChatOpenAI (Chat Completions or the
Responses API) or ChatAnthropic (Messages), configured only from the environment.

`LANGCHAIN_API=chat|responses|anthropic` picks the chat model; `LANGCHAIN_STREAM=1` streams the model
(`streaming=True`, consumed through `agent.stream(stream_mode="messages")`). The endpoints and keys are
the variables the SDKs read themselves (`OPENAI_BASE_URL`/`OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`/
`ANTHROPIC_API_KEY`, set by the agent contract); the model name is `RELAX_MODEL`. LangSmith stays off unless
`LANGSMITH_TRACING=true`. The conversation is exported implicitly (no output file).
"""

from __future__ import annotations

import os

from common import flag, shell, task_prompt
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.tools import tool


@tool
def bash(command: str) -> str:
    """Run a bash command and return its output."""
    return shell(command)


def chat_model(api: str, stream: bool) -> BaseChatModel:
    name = os.environ["RELAX_MODEL"]
    if api == "anthropic":
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(model=name, max_tokens=512, max_retries=0, streaming=stream)
    from langchain_openai import ChatOpenAI

    if api not in ("chat", "responses"):
        raise SystemExit(f"LANGCHAIN_API={api!r}: use chat, responses or anthropic")
    return ChatOpenAI(model=name, max_retries=0, streaming=stream, use_responses_api=api == "responses")


def main() -> None:
    stream = flag("LANGCHAIN_STREAM")
    agent = create_agent(chat_model(os.environ.get("LANGCHAIN_API", "chat"), stream), tools=[bash],
                         system_prompt="Solve the task. Use the bash tool to compute.")
    task = {"messages": [{"role": "user", "content": task_prompt()}]}
    if stream:
        for _chunk, _meta in agent.stream(task, stream_mode="messages"):
            pass
    else:
        print(agent.invoke(task)["messages"][-1].content)


if __name__ == "__main__":
    main()
