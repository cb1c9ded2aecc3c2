"""Test agent for `job=check`: two model calls with a tool call between them, re-sending the first reply the way
its mode says (argv[1]), like a harness with that habit:

- verbatim: the assistant message exactly as received;
- drop_reasoning: without its `reasoning_content`;
- reserialize: tool-call arguments re-serialized (other key order, indented): equal as JSON;
- flatten: the tool call written into the text, no `tool_calls`;
- malformed: tool-call arguments as Python's `str(dict)`, which is not JSON;
- silent: never calls the model.

Plain HTTP with the standard library (the hand-written form of the contract); reward 1.0.
"""

import json
import os
import sys
import urllib.request

MODE = sys.argv[1] if len(sys.argv) > 1 else "verbatim"
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": PARAMETERS}}]


def chat(messages: list) -> dict:
    url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def resent(reply: dict) -> dict:
    """The first reply as this mode re-sends it."""
    message = {k: v for k, v in reply.items() if v is not None}
    calls = message.get("tool_calls") or []
    if MODE == "drop_reasoning":
        message.pop("reasoning_content", None)
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        if MODE == "reserialize":
            call["function"]["arguments"] = json.dumps(dict(reversed(list(args.items()))), indent=2)
        elif MODE == "malformed":
            call["function"]["arguments"] = str(args)
    if MODE == "flatten" and calls:
        text = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                        "arguments": json.loads(c["function"]["arguments"])})
                         + "\n</tool_call>" for c in calls)
        message["content"] = ((message.get("content") or "") + "\n" + text).strip()
        message.pop("tool_calls")
    return message


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        messages = list(json.load(f)["messages"])
    if MODE != "silent":
        reply = chat(messages)
        call_id = (reply.get("tool_calls") or [{"id": "call_0"}])[0]["id"]
        messages += [resent(reply), {"role": "tool", "tool_call_id": call_id, "content": "print('hi')"}]
        chat(messages)
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": 1.0}, f)


if __name__ == "__main__":
    main()
