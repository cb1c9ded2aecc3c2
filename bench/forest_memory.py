"""Bytes the session forest keeps per stored token: compact arrays against the former tuple layout.

32 sessions each run 128 turns through the real turn service (chat parser, template, tokenizer; the
engine is a precomputed answer, given as fresh Python ints and floats each turn as a real engine gives
them). The forests' retained memory (tracemalloc, after the requests, memos and bodies are gone) is
divided by the tokens they store (every node's `token_ids`). Side by side, the same turns go into a
stand-in of the former layout: node fields as tuples of Python ints and floats, and the last eight
lineages cached as tuples.

    python bench/forest_memory.py [--sessions 32] [--turns 128] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import tracemalloc
from array import array
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson  # noqa: E402
from _smoke import parse_args  # noqa: E402
from forest import ANSWER, TOOLS, history  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from relax_pipeline.chat.parsers import OutputParser  # noqa: E402
from relax_pipeline.chat.template import ChatTemplate  # noqa: E402
from relax_pipeline.engine.base import GenerateResult  # noqa: E402
from relax_pipeline.forest.store import Node, SessionForest  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402
from relax_pipeline.protocol.chat import parse_request  # noqa: E402
from relax_pipeline.testing.engines import ScriptedEngine  # noqa: E402
from relax_pipeline.turn.service import SamplingDefaults, TurnService  # noqa: E402
from relax_pipeline.turn.sessions import Session  # noqa: E402


class TupleForest(SessionForest):
    """The former layout: tuples of Python ints and floats, and the last eight lineages cached as tuples."""

    def _add(self, node: Node, states: Sequence[bytes] = ()) -> Node:
        return super()._add(dataclasses.replace(
            node, token_ids=tuple(node.token_ids), logprobs=tuple(node.logprobs),
            weight_versions=tuple(node.weight_versions), train_ids=tuple(node.train_ids)), states)

    def prompt_ids(self, node: Node) -> list[int]:
        cache: dict[int, tuple[int, ...]] = self.__dict__.setdefault("tuple_cache", {})
        path, cursor = [], node
        while cursor is not None and cursor.id not in cache:
            path.append(cursor)
            cursor = self.nodes[cursor.parent] if cursor.parent is not None else None
        ids = list(cache[cursor.id]) if cursor is not None else []
        for step in reversed(path):
            ids.extend(step.token_ids)
        cache[node.id] = tuple(ids)
        if len(cache) > 8:
            del cache[next(iter(cache))]
        return ids


def fresh_output(ids: list[int], turn: int) -> GenerateResult:
    """An engine result as a real engine hands it over: new int and float objects (float32 logprobs)."""
    logprobs = array("f", [-((turn + i) % 97) / 37 for i in range(len(ids))]).tolist()
    return GenerateResult(tuple(array("i", ids).tolist()), tuple(logprobs), "stop", 3, ids[-1])


def run_sessions(svc: TurnService, ids: list[int], forest_type: type[SessionForest], sessions: int, turns: int
                 ) -> list[SessionForest]:
    """Interleaved turns of `sessions` sessions; each request is decoded anew from its JSON body."""
    live = [Session(f"s{s}", "g", 0, 0, "train", {}, forest=forest_type()) for s in range(sessions)]
    answer: dict = {}
    for t in range(1, turns + 1):
        body = orjson.dumps({"messages": history(t, answer), "tools": TOOLS})
        for session in live:
            request = parse_request(orjson.loads(body), session.memo)
            result = svc.commit(session.forest, svc.prepare(session.forest, request), fresh_output(ids, t))
            answer = result.message.to_openai()
    return [session.forest for session in live]


def retained(svc: TurnService, ids: list[int], forest_type: type[SessionForest], sessions: int, turns: int
             ) -> tuple[int, int]:
    """(bytes the forests keep, tokens they store)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    forests = run_sessions(svc, ids, forest_type, sessions, turns)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return kept, sum(len(n.token_ids) for f in forests for n in f.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=128)
    args = parse_args(parser, sessions=2, turns=8)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny(Path(tempfile.gettempdir()) / "relax-bench"))
    template = ChatTemplate(tokenizer)
    svc = TurnService(template, ScriptedEngine(tokenizer, [ANSWER]), OutputParser(),
                      SamplingDefaults(max_context_len=1 << 22, max_response_len=256))
    ids = tokenizer.encode(ANSWER, add_special_tokens=False) + list(template.end_of_turn_ids)
    rows = {name: retained(svc, ids, kind, args.sessions, args.turns)
            for name, kind in (("tuples (former)", TupleForest), ("compact (now)", SessionForest))}
    print(f"{args.sessions} sessions x {args.turns} turns")
    print(f"{'layout':<16} {'tokens':>9} {'MB kept':>8} {'bytes/token':>12}")
    for name, (kept, tokens) in rows.items():
        print(f"{name:<16} {tokens:>9} {kept / 1e6:>8.1f} {kept / tokens:>12.1f}")
    (old, old_tokens), (new, new_tokens) = rows.values()
    print(f"tuples / compact bytes per token: {(old / old_tokens) / (new / new_tokens):.2f} (target <= 64 bytes)")


if __name__ == "__main__":
    main()
