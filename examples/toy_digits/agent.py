"""The default training task: answer arithmetic questions in digits, over two model calls.

A task a random-init tiny model cannot already do but learns in minutes under GRPO. The agent asks the
question, then asks the model to check its answer and reply again. Each reply scores the share of its
non-space characters that are digits, plus 0.5 when it is exactly the right number; the reward is the
mean over both replies, capped at 1. It talks to the gateway with the standard library only (the
hand-written HTTP form of the contract: `RELAX_BASE_URL.rstrip('/') + '/v1/chat/completions'`), so a
session costs little more than a Python start.
"""

import json
import os
import urllib.request

CHECK = "Check your answer. Reply again with digits only."


def chat(messages: list) -> dict:
    url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": messages}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def score(reply: str, answer: str) -> float:
    chars = [c for c in reply if not c.isspace()]
    digits = sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0
    return digits + (0.5 if reply.strip() == answer else 0.0)


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    answer = str(task.get("metadata", {}).get("answer", ""))
    messages = list(task["messages"])
    scores = []
    for turn in range(2):
        if turn:
            messages.append({"role": "user", "content": CHECK})
        reply = chat(messages)
        messages.append(reply)
        scores.append(score(reply.get("content") or "", answer))
    reward = min(1.0, sum(scores) / len(scores))
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"digit_share": reward}}, f)


if __name__ == "__main__":
    main()
