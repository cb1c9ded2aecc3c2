"""`agent=arith_calc`: the arith task as a multi-turn agent with a calculator (`experiment=smollm2_agent`).

The session's input holds the question as one user message ("What is 47 * 86?") and the answer in
`metadata.answer`. The agent adds the calculator's instruction to the question, puts a worked example in front
when `ARITH_EXAMPLE` names one (`call`: an earlier question answered by a calc line, showing the format only;
`add`: a whole exchange, call, value and answer; `none`), and runs `calc.episode` over plain HTTP (the same
socket client as `agent=arith`): every `calc a op b` reply gets a `calculator: <value>` user turn, the first
other reply is the answer. With `metadata.tools` false (an eval entry's `metadata: {tools: false}`) it is the
single-shot control: the question alone, "Answer with just the number.", one call. It writes
`{"reward", "metadata"}` with `used_tool`, `turns`, `calls`, `malformed`, `too_many_turns` and `tools`, which
the run's rollout and eval metrics average; a chained problem (`metadata.steps`, `dataset.steps`) adds its
success and calls under its number of calls needed and whether its calls chained (`calc.Outcome.metadata`).
`ARITH_INSTRUCTION` picks the instruction (`one`, default, or `chain`: one operation a call, and a call of
several operations gets `calc.ONE_AT_A_TIME` back instead of the general error). `ARITH_NAME_FIRST=1` names
that call's first operation instead (`calc.FIRST_OPERATION`); `ARITH_ECHO=1` returns each value with its call.
A train problem with `metadata.given` (`dataset.train_given`) starts with that many of its calls made by the
environment's own calculator (`calc.made_calls`), shown as prompt. `ARITH_MAX_TURNS` (default 4) caps the
model's replies. The conversation
is exported implicitly; a worked example is part of every prompt, so it trains no tokens.
"""

import json
import os

from agent import chat
from calc import CONTROL, INSTRUCTION, INSTRUCTIONS, PLAIN, Replies, episode, made_calls

MAX_TURNS = int(os.environ.get("ARITH_MAX_TURNS", "4"))


def examples(instruction: str, replies: Replies = PLAIN) -> dict[str, list[dict]]:
    """Worked examples put in front of the question (`ARITH_EXAMPLE`, default `none`), with `instruction`;
    `chain`'s two calls are made by the environment's own calculator (`calc.made_calls`, worded by `replies`)."""
    return {
        "chain": [
            {"role": "user", "content": f"What is 12 + 34 - 5? {instruction}"},
            *made_calls([12, 34, 5], ["+", "-"], 2, replies),
            {"role": "assistant", "content": "The answer is 41."},
        ],
        "none": [],
        "add": [
            {"role": "user", "content": f"What is 12 + 34? {instruction}"},
            {"role": "assistant", "content": "calc 12 + 34"},
            {"role": "user", "content": "calculator: 46"},
            {"role": "assistant", "content": "The answer is 46."},
        ],
        "call": [
            {"role": "user", "content": f"What is 12 + 34? {instruction}"},
            {"role": "assistant", "content": "calc 12 + 34"},
        ],
    }


def opening(question: str, tools: bool, example: str = "none", instruction: str = INSTRUCTION,
            replies: Replies = PLAIN) -> list[dict]:
    """The session's first messages: a worked example (if any) and the question with the calculator's
    instruction, or the control's question alone."""
    if not tools:
        return [{"role": "user", "content": f"{question} {CONTROL}"}]
    return [*examples(instruction, replies)[example], {"role": "user", "content": f"{question} {instruction}"}]


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    metadata = task.get("metadata") or {}
    tools = bool(metadata.get("tools", True))
    question = task["messages"][-1]["content"]
    chain = os.environ.get("ARITH_INSTRUCTION", "one") == "chain"
    instruction = INSTRUCTIONS["chain" if chain else "one"]
    replies = Replies(one_at_a_time=chain, name_first=os.environ.get("ARITH_NAME_FIRST") == "1",
                      echo=os.environ.get("ARITH_ECHO") == "1")
    messages = opening(question, tools, os.environ.get("ARITH_EXAMPLE", "none"), instruction, replies)
    if tools and metadata.get("given"):
        messages += made_calls(metadata["numbers"], metadata["ops"], metadata["given"], replies)
    outcome = episode(chat, messages, metadata["answer"], MAX_TURNS, tools, replies)
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": outcome.reward, "metadata": outcome.metadata(tools, metadata.get("steps"))},
                  f)


if __name__ == "__main__":
    main()
