"""Test agent: one model call through the OpenAI SDK; like Claude Code or Codex, it stops with an error when
the turn was cut by the length limit (exit 3), and exits 0 otherwise."""

import json
import os
import sys

from openai import OpenAI

task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the agent contract
reply = client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=task["messages"])
if reply.choices[0].finish_reason == "length":
    print("error: the model's answer was cut off (finish_reason=length)", file=sys.stderr)
    sys.exit(3)
