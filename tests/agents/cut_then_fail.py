"""Test agent for tests/e2e/test_faults.py: one chat call over plain HTTP, then a reward; prompts holding a minus sign
("-") fail after a turn cut on `length`, as `CUT_THEN` says; prompts with "+" always behave.

CUT_MAX_TOKENS=N: the "-" prompts' request asks for `max_tokens: N` itself (else the pipeline's budget cuts).
CUT_THEN=exit: after a `length` turn, print why on stderr and exit 3 (like Claude Code or Codex).
CUT_THEN=hang: after a `length` turn, sleep until `agent.timeout` ends it.
"""

import json
import os
import sys
import time
import urllib.request

task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
faulty = "-" in json.dumps(task["messages"])
request = {"model": "m", "messages": task["messages"]}
if faulty and os.environ.get("CUT_MAX_TOKENS"):
    request["max_tokens"] = int(os.environ["CUT_MAX_TOKENS"])
url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]}
reply = json.load(urllib.request.urlopen(urllib.request.Request(url, json.dumps(request).encode(), headers)))
if faulty and reply["choices"][0]["finish_reason"] == "length":
    print(f"error: the answer was cut off after {reply['usage']['completion_tokens']} tokens (finish_reason=length)",
          file=sys.stderr, flush=True)
    if os.environ.get("CUT_THEN") == "hang":
        time.sleep(600)
    sys.exit(3)
json.dump({"reward": 1.0}, open(os.environ["RELAX_OUTPUT_JSON"], "w"))
