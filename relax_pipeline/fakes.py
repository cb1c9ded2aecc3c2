"""Every fake in the project, in one module: stand-ins for the edges, never for the parts under test.

- `ScriptedEngine`: an `Engine` that answers from a script of texts, tokenized with the real tokenizer
  and ended with the template's end-of-turn token, with fixed logprobs. Protocol and forest tests use it
  so their expected outputs are known; end-to-end tests use the real embedded engine instead.
- `StopStringEngine`: ends each scripted answer on the request's first stop string, as an engine that
  matched it would (for stop-reason rendering).
- `AbortingEngine` / `FailingEngine`: scripted engines whose Nth generation ends "abort", or that raise
  on every call like a dead worker, for the gateway's commit-nothing paths.
- `RecordingHFEngine`: the real embedded engine plus a record of every prompt it was given, selected
  with `engine._target_=relax_pipeline.fakes.RecordingHFEngine` so end-to-end tests can check that each
  turn's prompt starts with the previous turn's tokens. It changes no behaviour.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.hf import HFEngine

Script = Callable[[Sequence[int]], str]


class ScriptedEngine:
    """Answers each generate call with the next scripted text (or `script(prompt_ids)`)."""

    def __init__(self, tokenizer: Any, script: Sequence[str] | Script, end_of_turn: str = "<|im_end|>",
                 logprob: float = -0.5, delay_s: float = 0.0, max_context_len: int = 4096,
                 record_prompts: bool = True) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        self.logprob = logprob
        self.delay_s = delay_s
        self.weight_version = 0
        self.max_context_len = max_context_len
        self.prompts: list[list[int]] = []
        self.record_prompts = record_prompts
        self._calls = 0
        self._encoded: dict[str, list[int]] = {}

    async def start(self) -> None:
        return None

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        if self.record_prompts:
            self.prompts.append(list(input_ids))
        text = self.script(input_ids) if callable(self.script) else self.script[self._calls % len(self.script)]
        self._calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_of_turn_id]
        ids = list(self._encoded[text])
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return GenerateResult(tuple(ids), (self.logprob,) * len(ids), finish, self.weight_version,
                              self.end_of_turn_id if finish == "stop" else None)

    async def abort(self, rid: str) -> GenerateResult | None:
        return None

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.weight_version = version

    async def close(self) -> None:
        return None


class AbortingEngine(ScriptedEngine):
    """Answers call number `abort_at` (0-based) with finish_reason "abort", like an engine abort."""

    def __init__(self, tokenizer: Any, script: Sequence[str], abort_at: int) -> None:
        super().__init__(tokenizer, script)
        self.abort_at = abort_at

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid)
        if len(self.prompts) - 1 == self.abort_at:
            return dataclasses.replace(result, output_ids=result.output_ids[:1], logprobs=result.logprobs[:1],
                                       finish_reason="abort", matched_stop=None)
        return result


class StopStringEngine(ScriptedEngine):
    """Ends each answer on the request's first stop string, as an engine that matched it would."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid)
        return dataclasses.replace(result, output_ids=result.output_ids[:-1], logprobs=result.logprobs[:-1],
                                   matched_stop=sampling.stop[0])


class FailingEngine(ScriptedEngine):
    """Raises on every generate call, like a crashed engine worker."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        self.prompts.append(list(input_ids))
        raise RuntimeError("engine worker died")


class RecordingHFEngine(HFEngine):
    """HFEngine that remembers (prompt ids, output ids) per call; the last instance is kept for tests."""

    last: RecordingHFEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[int]]] = []
        RecordingHFEngine.last = self

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid)
        self.calls.append((list(input_ids), list(result.output_ids)))
        return result
