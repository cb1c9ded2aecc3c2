"""Golden forest → samples: a scripted multi-turn session with a branch, exported as two contexts.

Turns go through the real TurnService, chat parser, chat template and tiny tokenizer; the engine is
scripted with a different logprob and weight version per turn, so every field of a sample is known. The
samples (tokens, loss masks, logprobs, versions, readable token tables) are stored in
`tests/golden/forest_samples.json`; a change that moves a token shows as a diff there. Regenerate with

    python tests/unit/test_golden_samples.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.forest.export import ExportRecord, explicit_exports
from relax_pipeline.forest.sample import build_sample, token_table
from relax_pipeline.forest.store import SessionForest
from relax_pipeline.protocol.chat import parse_request
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults, TurnService

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "forest_samples.json"
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CALL = '<think>\nadd them\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]


class _Turns:
    """One session's turns, each generated at its own weight version and logprob."""

    def __init__(self, template: ChatTemplate) -> None:
        self.engine = ScriptedEngine(template.tokenizer, [CALL, "It is 3.", "Yes, 3.", "1 plus 2 makes 3."])
        self.service = TurnService(template, self.engine, OutputParser(), SamplingDefaults())
        self.forest = SessionForest()

    async def next(self, messages: list[dict[str, Any]], version: int, logprob: float) -> list[dict[str, Any]]:
        self.engine.weight_version, self.engine.logprob = version, logprob
        result = await self.service.run(self.forest, parse_request({"messages": messages, "tools": TOOLS}))
        return [*messages, result.message.to_openai()]


async def golden_samples(template: ChatTemplate) -> dict[str, Any]:
    """Turn 1 calls a tool, turn 2 answers; then the session forks into two follow-ups, both exported."""
    turns = _Turns(template)
    history = await turns.next(START, 0, -0.5)
    history = await turns.next([*history, {"role": "tool", "tool_call_id": "c1", "content": "3"}], 1, -0.25)
    sure = await turns.next([*history, {"role": "user", "content": "Sure?"}], 2, -0.125)
    explain = await turns.next([*history, {"role": "user", "content": "Explain."}], 2, -1.0)
    records = [ExportRecord("sure", sure, TOOLS, None, {}, 1.0), ExportRecord("explain", explain, TOOLS, None, {}, 0.0)]
    samples = {}
    for exported in explicit_exports(turns.forest, records):
        sample = build_sample(turns.forest, exported.node)
        samples[exported.name] = {
            "prompt_length": sample.prompt_length, "turn_count": sample.turn_count, "tokens": list(sample.tokens),
            "loss_mask": list(sample.loss_mask), "rollout_logprobs": list(sample.rollout_logprobs),
            "weight_versions": list(sample.weight_versions),
            "table": token_table(sample, template.tokenizer).splitlines(),
        }
    return {"fork_count": len(turns.forest.leaves()), "samples": samples}


def test_forest_samples_match_the_golden_file(template: ChatTemplate) -> None:
    produced = asyncio.run(golden_samples(template))
    expected = json.loads(GOLDEN.read_text())
    assert produced["fork_count"] == expected["fork_count"] == 2
    for name, want in expected["samples"].items():
        got = produced["samples"][name]
        assert got["table"] == want["table"], f"sample {name!r} moved; regenerate: python {Path(__file__).name}"
        assert got == want
    sure, explain = produced["samples"]["sure"], produced["samples"]["explain"]
    common = next(i for i, (a, b) in enumerate(zip(sure["tokens"], explain["tokens"], strict=False)) if a != b)
    generated = [(m, v) for m, v in zip(sure["loss_mask"], sure["weight_versions"], strict=True)]
    early = [j for j, (m, v) in enumerate(generated) if m == 1 and v < 2]
    assert early and max(early) < common - sure["prompt_length"], "both branches share the turns before the fork"


def _regenerate() -> None:
    from transformers import AutoTokenizer

    from relax_pipeline.models.tiny import build_tiny

    cache = os.environ.get("RELAX_TEST_CACHE") or tempfile.mkdtemp(prefix="tiny-cache-")
    template = ChatTemplate(AutoTokenizer.from_pretrained(build_tiny(cache, seed=0)))
    GOLDEN.write_text(json.dumps(asyncio.run(golden_samples(template)), indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)


if __name__ == "__main__":
    _regenerate()
