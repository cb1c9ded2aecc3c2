"""Test agent for `job=check`: a harness that edits its own earlier replies before re-sending them. Three model
calls in one conversation; before each later call, every earlier assistant reply is re-sent the way its mode
says (argv[1]):

- recase: its first letter's case swapped (a harness that "tidies" capitalisation);
- respace: its spaces doubled and a newline appended (a harness that re-wraps text);
- append: a note appended to it (a harness that annotates what the model said);
- verbatim: exactly as received.

Plain HTTP with the standard library (the hand-written form of the contract); reward 1.0.
"""

import json
import os
import sys
import urllib.request

MODE = sys.argv[1] if len(sys.argv) > 1 else "verbatim"
NOTE = " [edited by the harness]"
QUESTIONS = ("Go on.", "And then?")


def chat(messages: list) -> dict:
    url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": messages}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def resent(reply: dict) -> dict:
    """An earlier reply as this mode re-sends it."""
    message = {k: v for k, v in reply.items() if v is not None}
    return message | {"content": edited(message.get("content") or "")}


def edited(text: str) -> str:
    if MODE == "recase":
        return text[:1].swapcase() + text[1:]
    if MODE == "respace":
        return text.replace(" ", "  ") + "\n"
    if MODE == "append":
        return text + NOTE
    return text


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        head = list(json.load(f)["messages"])
    replies: list[dict] = []
    for _ in range(len(QUESTIONS) + 1):
        later = [m for reply, question in zip(replies, QUESTIONS, strict=False)
                 for m in (resent(reply), {"role": "user", "content": question})]
        replies.append(chat(head + later))
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": 1.0}, f)


if __name__ == "__main__":
    main()
