"""`agent=arith`: one model call per session over plain HTTP; the reward is the exact answer.

The session's input holds one user message ("What is 12 + 34? Answer with just the number.") and the
answer in `metadata.answer` (`dataset=arith`). The agent asks the model once and writes
`{"reward", "metadata"}`: reward 1.0 when the reply's last number is the answer
(`relax_pipeline.credit.examples.answer_reward`), and `has_number` (whether the reply holds an integer at all),
which separates getting the format right from getting the sum right. The conversation is exported implicitly.
A GRPO step starts a few hundred of these agents on the same cores as the engine, so their start-up CPU
is engine time lost. Starting the OpenAI SDK costs about 0.8 s of CPU per process (`agent=arith_tool` shows
the SDK); importing `urllib.request` (http.client, email, ssl) about 30 ms, half of this whole agent's CPU.
So a plain-HTTP base URL is spoken to over a socket (one HTTP/1.1 request, `Connection: close`), and
`https://` (a TLS proxy in `gateway.public_url`) goes through urllib.
"""

import json
import os
import socket
from urllib.parse import urlsplit

from relax_pipeline.credit.examples import answer_reward, last_integer

TIMEOUT_S = 600


def chat(messages: list[dict]) -> str:
    """One Chat Completions call to the session's endpoint; the reply's text."""
    body = json.dumps({"model": os.environ["RELAX_MODEL"], "messages": messages}).encode()
    url, key = os.environ["RELAX_BASE_URL"] + "v1/chat/completions", os.environ["RELAX_API_KEY"]
    reply = post(url, body, key) if url.startswith("http://") else post_tls(url, body, key)
    return reply["choices"][0]["message"].get("content") or ""


def post(url: str, body: bytes, key: str) -> dict:
    """POST a JSON `body` to an `http://` URL and return the JSON answer; an error names the status."""
    parts = urlsplit(url)
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=TIMEOUT_S) as conn:
        conn.sendall(head.encode() + body)
        answer = b"".join(iter(lambda: conn.recv(1 << 16), b""))
    status, _, rest = answer.partition(b"\r\n")
    headers, _, content = rest.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        content = dechunk(content)
    if status.split(b" ")[1:2] != [b"200"]:
        raise RuntimeError(f"{url} answered {status.decode(errors='replace')}: {content[:500]!r}")
    return json.loads(content)


def dechunk(data: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 answer (a proxy in front of the gateway may send one)."""
    parts = []
    while True:
        size, _, data = data.partition(b"\r\n")
        length = int(size.split(b";")[0], 16)
        if length == 0:
            return b"".join(parts)
        parts.append(data[:length])
        data = data[length + 2 :]


def post_tls(url: str, body: bytes, key: str) -> dict:
    """The same request through urllib (https)."""
    import urllib.request

    request = urllib.request.Request(url, body, {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
        return json.load(reply)


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    reply = chat(task["messages"])
    reward = answer_reward(reply, task["metadata"]["answer"])
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"has_number": float(last_integer(reply) is not None)}}, f)


if __name__ == "__main__":
    main()
