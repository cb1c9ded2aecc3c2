"""Test agent for tests/e2e/test_faults.py: one chat call over plain HTTP, then a reward, unless `FAULT` says
otherwise for prompts holding a minus sign ("-"); prompts with "+" always behave.

FAULT=kill: send the request on a raw socket, wait 0.3 s (the engine is still generating), SIGKILL itself.
FAULT=silent: exit 0 at once, no model call and no output file.
FAULT=noreward: (every prompt) answer but write no reward, so a reward model must score it.
"""

import json
import os
import signal
import socket
import sys
import time
import urllib.parse
import urllib.request

task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
fault = os.environ.get("FAULT", "")
faulty = "-" in json.dumps(task["messages"])
url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
body = json.dumps({"model": "m", "messages": task["messages"]}).encode()
auth = "Bearer " + os.environ["RELAX_API_KEY"]
if faulty and fault == "silent":
    sys.exit(0)
if faulty and fault == "kill":
    parts = urllib.parse.urlsplit(url)
    conn = socket.create_connection((parts.hostname, parts.port))
    head = (f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\nauthorization: {auth}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")
    conn.sendall(head.encode() + body)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
request = urllib.request.Request(url, body, {"Content-Type": "application/json", "Authorization": auth})
json.load(urllib.request.urlopen(request))
if fault != "noreward":
    json.dump({"reward": 1.0}, open(os.environ["RELAX_OUTPUT_JSON"], "w"))
