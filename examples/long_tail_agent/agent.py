"""A long-tailed agent workload for the runtime-mode tests and `bench/runtime_modes.py`.

Each session sleeps `startup_s` (agent start-up), then makes `turns` model calls with a log-normal "tool"
latency between them (`tool_mean_s`, `tool_sigma`, drawn from a generator seeded by the session id), and
exports the implicit context with reward 1. Settings come from the row's metadata, else from the
environment in upper case with the `LT_` prefix (`LT_STARTUP_S=2`), else the defaults below. It talks to
the gateway with the standard library (`RELAX_BASE_URL.rstrip('/') + '/v1/chat/completions'`) so a
session costs little more than a Python start, and appends one JSON line per event to
`$RELAX_SESSION_IO_DIR/events.jsonl`: `{"event": "request" | "response", "turn": n, "t": unix time}`.
"""

import json
import math
import os
import random
import time
import urllib.request

DEFAULTS = {"startup_s": 0.0, "turns": 2, "tool_mean_s": 0.0, "tool_sigma": 1.0, "max_tokens": 64}


def setting(metadata: dict, name: str) -> float:
    if name in metadata:
        return float(metadata[name])
    return float(os.environ.get("LT_" + name.upper(), DEFAULTS[name]))


def event(name: str, turn: int) -> None:
    path = os.path.join(os.environ["RELAX_SESSION_IO_DIR"], "events.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"event": name, "turn": turn, "t": time.time()}) + "\n")


def chat(messages: list, max_tokens: int) -> dict:
    url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def tool_latency(rng: random.Random, mean_s: float, sigma: float) -> float:
    if mean_s <= 0:
        return 0.0
    return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    meta = task.get("metadata") or {}
    rng = random.Random(os.environ["RELAX_SESSION_ID"])
    time.sleep(setting(meta, "startup_s"))
    messages = list(task["messages"])
    for turn in range(int(setting(meta, "turns"))):
        if turn:
            time.sleep(tool_latency(rng, setting(meta, "tool_mean_s"), setting(meta, "tool_sigma")))
            messages.append({"role": "user", "content": f"Tool result {turn}. Go on."})
        event("request", turn)
        messages.append(chat(messages, int(setting(meta, "max_tokens"))))
        event("response", turn)
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": 1.0}, f)


if __name__ == "__main__":
    main()
