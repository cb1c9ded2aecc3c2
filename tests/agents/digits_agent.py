"""Test agent for tests/e2e/test_stop_and_resume.py and test_kill_and_resume.py: one chat call over plain HTTP;
the reward is the number of digits in the reply / 4.

The gate lets a test stop a run mid-step: a train session of a group whose id starts with `$HOLD_GROUP` (for
example "g3-") first creates `started` in its session folder, then waits while the file `$HOLD_FILE` exists in
its working folder. Without `HOLD_GROUP` it never waits.
"""

import json
import os
import time
import urllib.request

group, hold = os.environ.get("HOLD_GROUP"), os.environ.get("HOLD_FILE", "hold")
if group and os.environ["RELAX_ROLLOUT_MODE"] == "train" and os.environ["RELAX_GROUP_ID"].startswith(group) \
        and os.path.exists(hold):
    open(os.path.join(os.environ["RELAX_SESSION_IO_DIR"], "started"), "w").close()
    while os.path.exists(hold):
        time.sleep(0.1)
task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
body = json.dumps({"model": "policy", "messages": task["messages"]}).encode()
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]}
reply = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers)))["choices"][0]["message"]
digits = sum(ch.isdigit() for ch in reply.get("content") or "")
with open(os.environ["RELAX_OUTPUT_JSON"], "w") as f:
    json.dump({"reward": digits / 4.0}, f)
