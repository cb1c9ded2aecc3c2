"""`agent=arith`: one model call per session over plain HTTP; the reward is the exact answer.

The session's input holds one user message ("What is 12 + 34? Answer with just the number.") and the
answer in `metadata.answer` (`dataset=arith`). The agent asks the model once and writes
`{"reward", "metadata"}`: reward 1.0 when the reply's last number is the answer
(`relax_pipeline.credit.examples.answer_reward`), and `has_number` (whether the reply holds an integer at all),
which separates getting the format right from getting the sum right. The conversation is exported implicitly.
It uses the standard library only: starting the OpenAI SDK costs about 0.8 s of CPU per process, and a GRPO
step starts a few hundred of these agents (`agent=arith_tool` shows the SDK).
"""

import json
import os
import urllib.request

from relax_pipeline.credit.examples import answer_reward, last_integer


def chat(messages: list[dict]) -> str:
    """One Chat Completions call to the session's endpoint; the reply's text."""
    body = json.dumps({"model": os.environ["RELAX_MODEL"], "messages": messages}).encode()
    request = urllib.request.Request(os.environ["RELAX_BASE_URL"] + "v1/chat/completions", body, {
        "Content-Type": "application/json", "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)["choices"][0]["message"].get("content") or ""


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    reply = chat(task["messages"])
    reward = answer_reward(reply, task["metadata"]["answer"])
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"has_number": float(last_integer(reply) is not None)}}, f)


if __name__ == "__main__":
    main()
