"""Gateway-side cost of one turn at turn 1 and turn 64 of the same session, and their ratio.

One turn here is everything the gateway does besides generation: parse the JSON body, canonicalize the
messages, match the chained hashes, tokenize the observation delta (or the full first prompt), decode
and parse the output, and commit both nodes. The engine is replaced by a precomputed answer (its cost
is not the gateway's). Each measured turn carries a fresh tool result, so no tokenization is skipped.
Side by side, the same turn done the naive way (re-render and re-tokenize the whole history, as a
proxy that does not keep token state must) shows what the delta compiler avoids.

    python bench/forest.py [--reps 200] [--smoke]

Memory the forest keeps per stored token: `bench/forest_memory.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402
from _smoke import parse_args  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from relax_pipeline.chat.parsers import OutputParser  # noqa: E402
from relax_pipeline.chat.template import ChatTemplate, Codec  # noqa: E402
from relax_pipeline.engine.base import GenerateResult  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402
from relax_pipeline.protocol.chat import parse_request  # noqa: E402
from relax_pipeline.testing.engines import ScriptedEngine  # noqa: E402
from relax_pipeline.turn.service import SamplingDefaults, TurnService  # noqa: E402
from relax_pipeline.turn.sessions import Session  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
ANSWER = ('I will look this up step by step to be sure about the details.\n<tool_call>\n'
          '{"name": "search", "arguments": {"query": "population of the largest city in the region"}}\n</tool_call>')
RESULT = "Result {i}: the city has about {n} people according to the latest census; see the record for more."


def history(turns: int, answer: dict) -> list[dict]:
    messages = [{"role": "system", "content": "You are a careful research agent."},
                {"role": "user", "content": "Find the population of the largest city in the region and explain."}]
    for i in range(turns - 1):
        call = dict(answer, tool_calls=[dict(answer["tool_calls"][0], id=f"call_{i}")])
        messages += [call, {"role": "tool", "tool_call_id": f"call_{i}", "content": RESULT.format(i=i, n=i * 1000)}]
    return messages


def build_session(svc: TurnService, output: GenerateResult, turns: int) -> tuple[Session, dict]:
    session = Session("bench", "g", 0, 0, "train", {})
    messages = history(1, {})
    first = svc.prepare(session.forest, parse_request({"messages": messages, "tools": TOOLS}, session.memo))
    answer = svc.commit(session.forest, first, output).message.to_openai()
    for t in range(2, turns + 1):
        body = json.loads(json.dumps({"messages": history(t, answer), "tools": TOOLS}))
        svc.commit(session.forest, svc.prepare(session.forest, parse_request(body, session.memo)), output)
    return session, answer


def one_turn(svc: TurnService, session: Session, body: bytes, output: GenerateResult) -> float:
    """What the gateway does per request besides generation and HTTP (the session memo included)."""
    start = time.process_time()
    prepared = svc.prepare(session.forest, parse_request(orjson.loads(body), session.memo))
    svc.commit(session.forest, prepared, output)
    return time.process_time() - start


def naive_turn(template: ChatTemplate, codec: Codec, body: bytes) -> float:
    """A full render and tokenize with nothing kept (`codec` keeps no pieces)."""
    start = time.process_time()
    request = parse_request(orjson.loads(body))
    codec.encode(template.render(request.messages, request.context, generation_prompt=True))
    return time.process_time() - start


def bodies(turn: int, answer: dict, reps: int) -> list[bytes]:
    out = []
    for r in range(reps):
        messages = history(turn, answer) if turn > 1 else history(1, {})
        messages[-1] = dict(messages[-1], content=messages[-1]["content"] + f" (variant {r})")
        out.append(json.dumps({"model": "m", "messages": messages, "tools": TOOLS}).encode())
    return out


def measure(svc: TurnService, output: GenerateResult, turns: tuple[int, ...], reps: int
            ) -> dict[int, tuple[float, float, int]]:
    """Median CPU ms per turn (ours, naive) and body size.

    Our turns of the three sizes are interleaved (as sessions interleave in a gateway) so machine noise
    hits all alike; the naive re-renders run in a loop of their own afterwards.
    """
    sessions = {t: build_session(svc, output, max(t - 1, 1)) for t in turns}
    work = {t: bodies(t, sessions[t][1], reps) for t in turns}
    ours: dict[int, list[float]] = {t: [] for t in turns}
    naive: dict[int, list[float]] = {t: [] for t in turns}
    codec = Codec(svc.template.tokenizer)
    codec.pieces = None  # the naive way keeps nothing between requests
    for r in range(reps):
        for t in turns:
            target = sessions[t][0] if t > 1 else Session("fresh", "g", 0, 0, "train", {})
            ours[t].append(one_turn(svc, target, work[t][r], output))
    for r in range(reps):
        for t in turns:
            naive[t].append(naive_turn(svc.template, codec, work[t][r]))
    return {t: (statistics.median(ours[t]) * 1e3, statistics.median(naive[t]) * 1e3, len(work[t][0]))
            for t in turns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parse_args(parser, reps=2)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    template = ChatTemplate(tokenizer)
    svc = TurnService(template, ScriptedEngine(tokenizer, [ANSWER]), OutputParser(),
                      SamplingDefaults(max_context_len=1 << 20, max_response_len=256))
    ids = tokenizer.encode(ANSWER, add_special_tokens=False) + list(template.end_of_turn_ids)
    output = GenerateResult(tuple(ids), (-0.1,) * len(ids), "stop", 0, template.end_of_turn_ids[0])
    rows = measure(svc, output, (1, 32, 64), args.reps)
    print(f"{'turn':>5} {'body KiB':>9} {'ours ms CPU':>12} {'naive re-render ms':>19} {'naive/ours':>11}")
    for turn, (ours, naive, size) in rows.items():
        print(f"{turn:>5} {size / 1024:>9.1f} {ours:>12.3f} {naive:>19.3f} {naive / ours:>11.1f}")
    ratio = rows[64][0] / rows[1][0]
    print(f"turn-64 / turn-1 cost ratio: {ratio:.2f} (target <= 2; budget <= 2 ms per turn at 32 turns: "
          f"{rows[32][0]:.3f} ms)")


if __name__ == "__main__":
    main()
