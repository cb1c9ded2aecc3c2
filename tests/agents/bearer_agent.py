"""Test agent: reports the base URL it was given and how the gateway answers its session id, then makes one
model call with the credential named by BEARER_AGENT_CREDENTIAL (`session_id`: RELAX_SESSION_ID, docs/design.md
§3.3's loopback promise; anything else: RELAX_API_KEY) through the OpenAI SDK, and exports implicitly."""

import json
import os
import urllib.error
import urllib.request

from openai import OpenAI

base_url = os.environ["RELAX_BASE_URL"]
probe = urllib.request.Request(base_url + "v1/models",
                               headers={"Authorization": f"Bearer {os.environ['RELAX_SESSION_ID']}"})
try:
    with urllib.request.urlopen(probe, timeout=30) as answer:
        id_status = answer.status
except urllib.error.HTTPError as error:
    id_status = error.code
use_id = os.environ.get("BEARER_AGENT_CREDENTIAL") == "session_id"
key = os.environ["RELAX_SESSION_ID"] if use_id else os.environ["RELAX_API_KEY"]
task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
OpenAI(base_url=base_url, api_key=key, max_retries=0).chat.completions.create(
    model=os.environ["RELAX_MODEL"], messages=task["messages"])
with open(os.environ["RELAX_OUTPUT_JSON"], "w") as out:
    json.dump({"reward": 1.0, "metadata": {"base_url": base_url, "id_status": id_status}}, out)
