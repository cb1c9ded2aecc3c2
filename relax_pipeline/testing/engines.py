"""Fake engines and trainers: stand-ins for the edges, never for the parts under test.

- `ScriptedEngine`: an `Engine` that answers from a script of texts, tokenized with the real tokenizer
  and ended with the template's end-of-turn token, with fixed logprobs. Protocol and forest tests use it
  so their expected outputs are known; end-to-end tests use the real embedded engine instead. Given a
  `vision`, it stands in for a vision-language engine (records the images it gets, ignores them).
- `StopStringEngine`: ends each scripted answer on the request's first stop string, as an engine that
  matched it would (for stop-reason rendering).
- `AbortingEngine` / `FailingEngine`: scripted engines whose Nth generation ends "abort", or that raise
  on every call like a dead worker, for the gateway's commit-nothing paths.
- `RecordingHFEngine`: the real embedded engine plus a record of every prompt it was given, selected
  with `engine._target_=relax_pipeline.testing.engines.RecordingHFEngine` so end-to-end tests can check that each
  turn's prompt starts with the previous turn's tokens. It changes no behaviour.
- `PacedEngine` / `PacedTrainer`: a simulated engine whose time is proportional to tokens (abortable,
  resumable, per-token weight versions) and a trainer whose step is a fixed sleep, for the runtime-mode
  tests and `bench/runtime_modes.py`, which measure the scheduler rather than the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams, varying
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun
from relax_pipeline.train.provenance import version_lag
from relax_pipeline.train.settings import TrainerRun, TrainerSettings

Script = Callable[[Sequence[int]], str]


class FakeLifecycle:
    """The `Engine` members a fake that holds no model needs: nothing to abort or close, no metrics, no batch
    limit of its own; weight updates only advance the version its tokens carry."""

    weight_version: int = 0
    max_batch_size: int = 256
    vision: Any = None
    """Text-only unless the fake sets an image processor (`ScriptedEngine(vision=...)`)."""

    in_flight_updates = False
    """Generations are aborted around a weight update (`Engine.in_flight_updates`)."""

    async def close_session(self, session_id: str) -> None:
        """Nothing is kept per agent session (`Engine.close_session`)."""

    def step_metrics(self) -> dict[str, float]:
        return {}

    async def start(self) -> None:
        return None

    async def abort(self, rid: str) -> GenerateResult | None:
        return None

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.weight_version = version

    async def update_adapter(self, adapter: Any, version: int) -> None:
        """A LoRA adapter (`Engine.update_adapter`): only its version is kept, as for full weights."""
        self.weight_version = version

    async def close(self) -> None:
        return None


class ScriptedEngine(FakeLifecycle):
    """Answers each generate call with the next scripted text (or `script(prompt_ids)`)."""

    def __init__(self, tokenizer: Any, script: Sequence[str] | Script, end_of_turn: str = "<|im_end|>",
                 logprob: float = -0.5, delay_s: float = 0.0, max_context_len: int = 4096,
                 record_prompts: bool = True, vision: Any = None) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        self.logprob = logprob
        self.delay_s = delay_s
        self.weight_version = 0
        self.max_context_len = max_context_len
        self.prompts: list[list[int]] = []
        self.media: list[tuple[ImageFeatures, ...]] = []
        """The images given with each recorded prompt."""
        self.vision = vision
        """A `Vision` to act as a vision-language engine (the turn service reads it); None: text-only."""
        self.record_prompts = record_prompts
        self._calls = 0
        self._encoded: dict[str, list[int]] = {}

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        if self.record_prompts:
            self.prompts.append(list(input_ids))
            self.media.append(tuple(media or ()))
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



class AbortingEngine(ScriptedEngine):
    """Answers call number `abort_at` (0-based) with finish_reason "abort", like an engine abort."""

    def __init__(self, tokenizer: Any, script: Sequence[str], abort_at: int) -> None:
        super().__init__(tokenizer, script)
        self.abort_at = abort_at

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid, media)
        if len(self.prompts) - 1 == self.abort_at:
            return dataclasses.replace(result, output_ids=result.output_ids[:1], logprobs=result.logprobs[:1],
                                       finish_reason="abort", matched_stop=None)
        return result


class StopStringEngine(ScriptedEngine):
    """Ends each answer on the request's first stop string, as an engine that matched it would."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid, media)
        return dataclasses.replace(result, output_ids=result.output_ids[:-1], logprobs=result.logprobs[:-1],
                                   matched_stop=sampling.stop[0])


class FailingEngine(ScriptedEngine):
    """Raises on every generate call, like a crashed engine worker."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        self.prompts.append(list(input_ids))
        raise RuntimeError("engine worker died")


class RecordingHFEngine(HFEngine):
    """HFEngine that remembers (prompt ids, output ids) per call; the last instance is kept for tests."""

    last: RecordingHFEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[int]]] = []
        self.media: list[tuple[ImageFeatures, ...]] = []
        RecordingHFEngine.last = self

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid, media)
        self.calls.append((list(input_ids), list(result.output_ids)))
        self.media.append(tuple(media or ()))
        return result


LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclasses.dataclass(eq=False)
class _Paced:
    """One request of `PacedEngine`: how many tokens it still owes and what it produced."""

    rid: str
    remaining: int
    limit: int
    offset: int
    """Tokens this rid produced before an abort (a resumed generation continues the letter cycle)."""
    future: asyncio.Future[GenerateResult]
    output: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PacedEngineSettings:
    """`engine=paced` (after `register_paced()`): the simulated engine's node."""

    _target_: str = "relax_pipeline.testing.engines.PacedEngine"
    token_s: float = 0.002
    """Seconds per decode tick (every active request gets one token a tick)."""
    mean_tokens: float = 24.0
    """Mean generation length (log-normal)."""
    sigma: float = 0.8
    """Log-normal sigma of the generation length."""
    max_batch_size: int = 256
    """Requests decoded together."""


@dataclasses.dataclass
class PacedTrainerSettings(TrainerSettings):
    """`trainer=paced` (after `register_paced()`): the trainer node plus the fixed step time."""

    _target_: str = "relax_pipeline.testing.engines.PacedTrainer"
    train_s: float = 1.0
    """Wall seconds each training step takes."""


def register_paced() -> None:
    """Add `engine=paced` and `trainer=paced` to the config groups (tests and benches call it after
    `config.register()`; the runtime never does)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="engine", name="paced", node=PacedEngineSettings)
    store.store(group="trainer", name="paced", node=PacedTrainerSettings)


class PacedEngine:
    """A simulated continuous-batching engine whose time is proportional to tokens.

    Every `token_s` seconds each active request (up to `max_batch_size`) gets one token, the letters
    " a", " b", ... " z" in a cycle counted from the generation's first token, until its length is
    reached; then it ends with the end-of-turn id ("stop"). A request's length
    is log-normal (`mean_tokens`, `sigma`) drawn from its sampling seed, capped by `max_new_tokens`
    ("length"). `abort` returns the partial output; a generation resumed under the same rid owes only
    the rest. Each token records the weight version current when it was emitted. `busy_s` counts the time
    at least one request was active. Selected with `engine._target_=relax_pipeline.testing.engines.PacedEngine`
    (extra keys with `+engine.token_s=...`) so scheduler tests and `bench/runtime_modes.py` measure the
    scheduler, not the model. The last instance built is `PacedEngine.last`.
    """

    last: PacedEngine | None = None
    vision: Any = None
    """Text-only: the simulated engine takes no images."""

    def __init__(self, settings: PacedEngineSettings, run: EngineRun) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(run.model_path)
        self.token_s, self.mean_tokens, self.sigma = settings.token_s, settings.mean_tokens, settings.sigma
        self.max_batch_size, self.max_context_len, self.seed = settings.max_batch_size, run.max_context_len, run.seed
        self.stop_id = self.tokenizer.convert_tokens_to_ids(run.end_of_turn or "<|im_end|>")
        self.letters = [self.tokenizer.encode(f" {c}", add_special_tokens=False)[-1] for c in LETTERS]
        self.weight_version = 0
        self.busy_s = 0.0
        self.busy_spans: list[tuple[float, float]] = []
        """Wall-clock (start, end) of every decode tick, for busy fractions over a window."""
        self.tokens = 0
        self._active: dict[str, _Paced] = {}
        PacedEngine.last = self
        self._owed: dict[str, tuple[int, int]] = {}
        self._ticker: asyncio.Task | None = None

    async def start(self) -> None:
        return None

    def _length(self, sampling: SamplingParams) -> int:
        rng = random.Random(sampling.seed if sampling.seed is not None else self.seed)
        mu = math.log(self.mean_tokens) - self.sigma ** 2 / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Any = None, session_id: str | None = None) -> GenerateResult:
        owed, offset = self._owed.pop(rid, None) or (self._length(sampling), 0)
        loop = asyncio.get_running_loop()
        request = _Paced(rid, owed, sampling.max_new_tokens, offset, loop.create_future())
        self._active[rid] = request
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.ensure_future(self._tick())
        try:
            return await request.future
        finally:
            self._active.pop(rid, None)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while self._active:
            started, wall = loop.time(), time.time()
            await asyncio.sleep(self.token_s)
            self.busy_s += loop.time() - started
            self.busy_spans.append((wall, time.time()))
            for request in list(self._active.values())[: self.max_batch_size]:
                self._emit(request)

    def _emit(self, request: _Paced) -> None:
        if request.future.done():
            return
        request.remaining -= 1
        position = request.offset + len(request.output)
        token = self.stop_id if request.remaining <= 0 else self.letters[position % len(self.letters)]
        request.output.append(token)
        request.versions.append(self.weight_version)
        self.tokens += 1
        if token == self.stop_id:
            self._finish(request, "stop")
        elif len(request.output) >= request.limit:
            self._finish(request, "length")

    def _finish(self, request: _Paced, reason: str) -> GenerateResult:
        versions = tuple(request.versions)
        result = GenerateResult(tuple(request.output), (-0.5,) * len(request.output), reason,  # type: ignore[arg-type]
                                versions[-1] if versions else self.weight_version,
                                self.stop_id if reason == "stop" else None,
                                varying(versions))
        self._active.pop(request.rid, None)
        if not request.future.done():
            request.future.set_result(result)
        return result

    async def abort(self, rid: str) -> GenerateResult | None:
        request = self._active.get(rid)
        if request is None:
            return None
        self._owed[rid] = (request.remaining, request.offset + len(request.output))
        return self._finish(request, "abort")

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self.weight_version = version

    async def update_adapter(self, adapter: Any, version: int) -> None:
        """A LoRA adapter (`Engine.update_adapter`): only its version is kept."""
        self.weight_version = version

    in_flight_updates = False
    """Generations are aborted around a weight update (`Engine.in_flight_updates`)."""

    async def close_session(self, session_id: str) -> None:
        """Nothing is kept per agent session (`Engine.close_session`)."""

    def step_metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        for request in list(self._active.values()):
            self._finish(request, "abort")


class PacedTrainer:
    """A trainer whose step takes `train_s` seconds of wall time and changes nothing but the version.

    Selected with `trainer=paced` once `register_paced()` has added the option (`trainer.train_s=...`) by
    `bench/runtime_modes.py`, so the optimizer step is a fixed, known gap the runtime modes can hide.
    """

    def __init__(self, settings: PacedTrainerSettings, run: TrainerRun) -> None:
        self.train_s = settings.train_s
        self.version = 0
        self.steps = 0

    def train(self, samples: Sequence[Any]) -> dict[str, float]:
        lag = version_lag(samples, self.version)
        time.sleep(self.train_s)
        self.version += 1
        self.steps += 1
        return {"train/loss": 0.0, **lag}

    def engine_weights(self) -> dict[str, Any]:
        return {}

    def engine_adapter(self) -> None:
        """Full weights (no `trainer.lora`): the loop syncs `engine_weights`."""
        return None

    def save(self, path: Any, extra: dict[str, Any]) -> None:
        return None

    def load(self, path: Any) -> dict[str, Any]:
        raise NotImplementedError("PacedTrainer keeps no state to resume from")

    def close(self) -> None:
        return None
