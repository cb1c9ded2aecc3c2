"""Test agent for the run viewer: two model calls, then (on most prompts) a third that rewrites its first answer,
so the session forks like a harness that edits its history; a prompt holding "fail" fails on purpose (exit 3).

Reward: 1.0 when the last answer's length is even, so groups have different rewards and training has signal.
Implicit export (only a reward in RELAX_OUTPUT_JSON): a forked session exports one row per chain (`branch`).
"""

import json
import os
import sys

from openai import OpenAI

task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
if "fail" in json.dumps(task["messages"]):
    print("forking agent: this prompt fails on purpose", file=sys.stderr)
    sys.exit(3)
client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)


def ask(messages: list) -> str:
    reply = client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=messages)
    return reply.choices[0].message.content or ""


messages = list(task["messages"])
first = ask(messages)
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Check your answer."}]
last = ask(messages)
if "+" in json.dumps(task["messages"]):  # rewrite the first answer: the gateway records a fork
    edited = [*task["messages"], {"role": "assistant", "content": "Let me start over."},
              {"role": "user", "content": "Answer with one number."}]
    last = ask(edited)
with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
    json.dump({"reward": float(len(last) % 2 == 0)}, f)
