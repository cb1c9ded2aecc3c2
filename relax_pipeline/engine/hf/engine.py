"""`engine=hf`: the embedded, in-process transformers engine with continuous batching.

`HFEngine` implements the `Engine` protocol of `base.py` on any `AutoModelForCausalLM` checkpoint. One
worker thread owns the model and runs the decode loop; the asyncio side only queues commands (generate,
abort, weight update, close) and gets results back via `loop.call_soon_threadsafe`, so the event loop
serving HTTP never waits on the model.

Continuous batching: at every step boundary the worker applies queued commands in order, admits waiting
requests (up to `max_batch_size` active), then runs one decode step for all active requests of all
sessions (attention mask, per-row positions). While a batch decodes, arrivals are admitted together rather
than one pass each: a round runs once the waiting requests fill a quarter of the batch's free room, or the
oldest has waited `ADMIT_AFTER_STEPS` decode steps (agents that start one by one would otherwise cost a
whole forward pass per arrival, a pass costing about a decode step). Admission prefills the requests that
arrived together in batched passes (`batch.Prefiller`) through the prefix KV cache (`prefix_cache.py`, a
radix tree over token ids within `kv_cache_mb`, LRU): prefixes several of them share (a GRPO group's prompt, the chat
template's preamble) are computed once, and each request prefills only the tokens after its longest cached
prefix, so a session's next turn (its previous prompt + generated tokens + observation) and a group's
siblings skip what was computed before. The result merges into the shared padded batch cache. Prompts
are cached after prefill, and prompt + generated tokens when a request leaves; a weight update clears
the cache; when memory runs short the cache is released (a prefill pass is then retried once). Finished
requests leave at once and all-padding leading cache columns are trimmed. Logits match a solo uncached
run up to float rounding of padded attention (tests: greedy and seeded tokens identical, logprobs within
1e-4). `threads` sets torch's intra-op thread count (None keeps torch's default).

Contracts: per-request sampling and full-vocabulary float32 logprobs before top-k/top-p (`sampling.py`);
stop token ids (request's plus engine default) end with "stop" and are kept; stop strings end with
"stop", `matched_stop` is the string and tokens stay as generated; a prompt over `max_context_len`
raises ValueError and output ends with "length" at `max_new_tokens` or a full context. `update_weights`
applies between two decode steps: in-flight requests continue with the new weights from the next step
(their older KV cache is kept, as SGLang does); each token records the version that sampled it,
`weight_version` is the version at the last token and `weight_versions` is filled only when they
differ. `abort` ends a request at the next step boundary; `generate` and `abort` return the same partial
result with "abort". Cancelling a `generate` task aborts its request.

Vision-language models (a folder whose config has a `vision_config`, such as `model=tiny_vl`): a request's
`media` (processed images, one per unexpanded placeholder token in `input_ids`) are expanded into the
prompt at submission, so the cache, `max_context_len` and `cached_len` count the expanded length. Its
prefill feeds the pixels with 3-D mrope positions from the model's own `get_rope_index`, and records the
rope delta (how far text positions after the images lag behind the token count); each decode row's
position is `cached_len + delta`, which is 0 for text prompts, so the text path is unchanged. `vision`
(the model's image processor, `vision.py`) is loaded at start for the turn service to use.

`engine.admission=program` (`program_admission.py`) admits agent sessions against the prefix cache in tokens.

Not supported: sliding-window attention layers (the padded shared cache treats every layer as full),
prefix caching of prompts with images (they prefill alone, uncached), speculative decoding; stop strings
never match across the prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoTokenizer

from relax_pipeline.engine.base import (
    DEFAULT_ADAPTER,
    AdapterWeights,
    FinishReason,
    GenerateResult,
    ImageFeatures,
    SamplingParams,
    derive_seed,
    expand_placeholders,
)
from relax_pipeline.engine.hf.adapters import BASE
from relax_pipeline.engine.hf.batch import Batch, ModelCall, Prefilled, Prefiller, Request, memory_short, take
from relax_pipeline.engine.hf.prefix_cache import PrefixCache
from relax_pipeline.engine.program_admission import ProgramAdmission, hf_capacity_tokens
from relax_pipeline.engine.sampling import (
    StopStringMatcher,
    Workspace,
    check_sampling,
    make_generator,
    sample_rows,
)
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.engine.vision import Vision
from relax_pipeline.models.adapter_folder import adapter_config as read_adapter_config
from relax_pipeline.models.adapter_folder import adapter_tensors, base_model, is_adapter_folder
from relax_pipeline.models.attention import check_implementation
from relax_pipeline.models.spec import load_pretrained

Command = Callable[[], None]
_log = logging.getLogger(__name__)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], value: Any) -> None:
    """Complete `future` on its loop from any thread; an exception value becomes the exception."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


ADMIT_AFTER_STEPS = 3
"""Decode steps a request may wait for company before it is admitted alone (see the module)."""


class _Scheduler:
    """The worker thread's state: waiting queue, active batch, and the step loop."""

    def __init__(self, engine: HFEngine, model: torch.nn.Module, tokenizer: Any) -> None:
        self.engine = engine
        self.call = ModelCall(model)
        self.tokenizer = tokenizer
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.waiting: deque[Request] = deque()
        self.batch = Batch()
        self.live: dict[str, Request] = {}
        self.stopping = False
        self.prefillers: dict[str, Prefiller] = {}
        """One prefiller per LoRA adapter in use (`BASE` for the base weights), each with its own prefix cache of
        `kv_cache_mb`: KV computed under one adapter is never another's."""
        self.versions: dict[str, int] = {}
        """Each loaded adapter's weight version (the tokens of its rows are stamped with it)."""
        self.space = Workspace()

    @property
    def prefix(self) -> PrefixCache:
        """The base weights' prefix cache."""
        return self.prefiller_of(BASE).prefix

    def prefiller_of(self, adapter: str) -> Prefiller:
        """The prefiller (and prefix cache) of `adapter`'s requests, made on first use."""
        if adapter not in self.prefillers:
            cache = PrefixCache(self.engine.kv_cache_mb * 2**20)
            self.prefillers[adapter] = Prefiller(self.call, cache, self.engine.stats, adapter)
        return self.prefillers[adapter]

    def clear_caches(self) -> None:
        """Drop every adapter's cached KV (new base weights, or memory ran short)."""
        for prefiller in self.prefillers.values():
            prefiller.prefix.clear()

    def remember(self, rows: list[int]) -> None:
        """Cache the KV of batch rows about to leave, each in its adapter's prefix cache."""
        for adapter, indices in _by_adapter([self.batch.rows[i] for i in rows], rows).items():
            self.prefiller_of(adapter).remember(self.batch, indices)

    def run(self) -> None:
        """Thread body: apply commands, admit, decode; abort whatever is left on exit."""
        if self.engine.threads:
            torch.set_num_threads(self.engine.threads)
        with torch.inference_mode():
            while not self.stopping:
                self._drain(block=not (self.waiting or self.batch.rows))
                if self.stopping:
                    break
                self._admit()
                self._step()
            self._drain(block=False)
            for request in list(self.live.values()):
                self._finish(request, "abort")

    def _drain(self, block: bool) -> None:
        """Run queued commands; wait for the first one when there is nothing else to do."""
        try:
            command = self.commands.get(block=block)
            while True:
                self._run_command(command)
                command = self.commands.get_nowait()
        except queue.Empty:
            return

    @staticmethod
    def _run_command(command: Command) -> None:
        try:
            command()
        except Exception:  # a command must never kill the worker thread
            _log.exception("hf engine command failed")

    def submit(self, request: Request) -> None:
        """Command: queue a request for admission."""
        if request.rid in self.live:
            _resolve(request.loop, request.future, ValueError(f"rid {request.rid!r} is already generating"))
            return
        if request.adapter is None:
            request.adapter = DEFAULT_ADAPTER if DEFAULT_ADAPTER in self.versions else BASE
        elif request.adapter not in self.versions and request.adapter != BASE:
            _resolve(request.loop, request.future, ValueError(
                f"adapter {request.adapter!r} is not loaded; the engine serves {sorted(self.versions) or 'none'}"))
            return
        self.live[request.rid] = request
        request.queued_at = int(self.engine.stats["steps"])
        self.waiting.append(request)

    def abort(self, rid: str, reply: Callable[[GenerateResult | None], None]) -> None:
        """Command: end request `rid` now with its partial output, or reply None if unknown."""
        request = self.live.get(rid)
        if request is None:
            reply(None)
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.remember([i for i, row in enumerate(self.batch.rows) if row is request])
            self.batch.keep([i for i, row in enumerate(self.batch.rows) if row is not request])
        reply(self._finish(request, "abort"))

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Command: copy `state_dict` into the model and serve it as `version` from the next step."""
        model = self.call.model
        current = model.state_dict()
        unknown = sorted(set(state_dict) - set(current))
        if unknown:
            raise ValueError(f"update_weights got keys the model does not have: {unknown[:5]}")
        wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(current[k].shape)]
        if wrong:
            raise ValueError(f"update_weights got tensors of the wrong shape for: {wrong[:5]}")
        with torch.inference_mode(False), torch.no_grad():
            model.load_state_dict(state_dict, strict=False)
        self.clear_caches()
        self.engine.weight_version = version

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Command: load LoRA `adapter` (engine/hf/adapters.py) and serve it as `version` from the next step."""
        self.call.load_adapter(adapter)
        self.prefiller_of(adapter.name).prefix.clear()
        self.versions[adapter.name] = version
        if adapter.name == DEFAULT_ADAPTER:
            self.engine.weight_version = version
            self.prefiller_of(BASE).prefix.clear()  # requests naming no adapter take this one from now on

    def stop(self) -> None:
        """Command: leave the loop after this round of commands."""
        self.stopping = True

    def _admit(self) -> None:
        """Prefill the waiting requests that fit in the batch, text prompts together, images alone."""
        started = time.perf_counter()
        room = self.engine.max_batch_size - len(self.batch.rows)
        if not self._admission_due(room):
            return
        group = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        for request in group:
            if request.sampling.stop:
                request.matcher = StopStringMatcher(self.tokenizer, request.sampling.stop)
                request.matcher.prime(request.sampling.stop_context)
            request.epoch = self.prefiller_of(request.adapter).prefix.epoch
        for request in (r for r in group if r.media):
            self._guarded([request], lambda rows: self._join(rows, self.prefiller_of(rows[0].adapter).media(rows[0])))
        text = [r for r in group if not r.media]
        for adapter, rows in _by_adapter(text, text).items():
            self._guarded(rows, self._prefill_text(self.prefiller_of(adapter)))
        if group:
            self.engine.stats["prefill_s"] += time.perf_counter() - started

    def _prefill_text(self, prefiller: Prefiller) -> Callable[[list[Request]], object]:
        """Prefill text rows through `prefiller` (their adapter's), each pass's rows joining the batch."""
        return lambda rows: [self._join(part, done) for part, done in prefiller.text(rows)]

    def _admission_due(self, room: int) -> bool:
        """Whether to run an admission round now (see the module: arrivals are gathered while a batch decodes)."""
        if not self.waiting or room <= 0:
            return False
        if not self.batch.rows or len(self.waiting) >= max(1, room // 4):
            return True
        return self.engine.stats["steps"] - self.waiting[0].queued_at >= ADMIT_AFTER_STEPS

    def _guarded(self, requests: list[Request], prefill: Callable[[list[Request]], object]) -> None:
        """Run `prefill`; on failure fail those of `requests` it had not yet prefilled."""
        try:
            prefill(requests)
        except Exception as error:  # noqa: BLE001 - the failure belongs to these requests only
            if memory_short(error):
                self.clear_caches()
            for request in requests:
                if not request.output_ids and self.live.pop(request.rid, None) is not None:
                    _resolve(request.loop, request.future, error)

    def _join(self, rows: list[Request], done: Prefilled) -> None:
        """Sample each prefilled row's first token; rows not finished by it join the decode batch."""
        self.engine.stats["prefills"] += len(rows)
        reasons = self._sample(rows, done.logits)
        for request, reason in zip(rows, reasons, strict=True):
            if reason is not None:
                self._finish(request, reason)
        keep = [i for i, reason in enumerate(reasons) if reason is None]
        if keep:
            cache, mask = (done.cache, done.mask) if len(keep) == len(rows) else take(done.cache, done.mask, keep)
            self.batch.add([rows[i] for i in keep], cache, mask)

    def _step(self) -> None:
        """One decode step for the whole batch; finished rows leave it."""
        rows = self.batch.rows
        if not rows:
            return
        started = time.perf_counter()
        try:
            reasons = self._sample(rows, self.call.decode(self.batch))
        except Exception as error:  # noqa: BLE001 - fail the batch, keep serving new requests
            if memory_short(error):
                self.clear_caches()
            self.batch.keep([])
            for request in rows:
                self.live.pop(request.rid, None)
                _resolve(request.loop, request.future, error)
            return
        self.engine.stats["steps"] += 1
        self.engine.stats["decode_s"] += time.perf_counter() - started
        self.engine.stats["max_batch"] = max(self.engine.stats["max_batch"], len(rows))
        self.remember([i for i, reason in enumerate(reasons) if reason is not None])
        for request, reason in zip(rows, reasons, strict=True):
            if reason is not None:
                self._finish(request, reason)
        self.batch.keep([i for i, reason in enumerate(reasons) if reason is None])

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> list[FinishReason | None]:
        """Sample one token per row and record it with the current weight version."""
        tokens, logprobs = sample_rows(logits, [r.sampling for r in rows], [r.generator for r in rows], self.space)
        version, versions = self.engine.weight_version, self.versions
        self.engine.stats["tokens"] += len(rows)
        return [r.push(t, lp, versions.get(r.adapter, version))  # type: ignore[arg-type] - set at submission
                for r, t, lp in zip(rows, tokens, logprobs, strict=True)]

    def _finish(self, request: Request, reason: FinishReason) -> GenerateResult:
        """Deliver the result to the waiting `generate` call and forget the request."""
        result = request.result(reason, self.engine.weight_version)
        self.live.pop(request.rid, None)
        _resolve(request.loop, request.future, result)
        return result


def _by_adapter(requests: Sequence[Request], keys: Sequence[Any]) -> dict[str, list[Any]]:
    """`keys` (one per request: the request or its batch row) grouped by the request's adapter, in order."""
    groups: dict[str, list[Any]] = {}
    for request, key in zip(requests, keys, strict=True):
        groups.setdefault(request.adapter or BASE, []).append(key)
    return groups


def _call(function: Callable[..., None], *args: Any) -> BaseException | None:
    """Run `function`; return the exception it raised (to hand to an awaiting caller) or None."""
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 - delivered to the caller, not swallowed
        return error
    return None


def _load(model_path: str, device: str, dtype: str, attention: str | None) -> tuple[torch.nn.Module, Any]:
    """Load model (eval mode, on `device`, `dtype` by its torch name) and tokenizer from a local HF folder (of an
    adapter folder: its base model; `HFEngine.start` loads the adapter)."""
    weights = base_model(model_path) if is_adapter_folder(model_path) else model_path
    model = load_pretrained(weights, dtype, attention)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model.to(device).eval(), tokenizer


STEP_METRICS = {"prefill_s": "prefill_s", "decode_s": "decode_s", "prefill_tokens": "prefill_tokens",
                "cached_tokens": "cached_tokens", "steps": "decode_steps", "tokens": "generated_tokens"}
"""`stats` key → the `engine/<name>` metric `step_metrics` reports per step."""


class HFEngine:
    """Embedded transformers engine: continuous batching in one worker thread, async API outside.

    `stats` counts decode `steps`, `prefills` (requests), sampled `tokens`, the largest decode batch
    (`max_batch`), prefill forward passes (`prefill_passes`), tokens computed by prefills
    (`prefill_tokens`) and prompt tokens taken from the prefix cache instead (`cached_tokens`), and the
    worker's seconds in admission rounds (`prefill_s`: prefill and first tokens) and in decode steps
    (`decode_s`); it is written by the worker thread and safe to read at any time. `step_metrics` reports
    them per training step.
    """

    def __init__(self, settings: HFEngineSettings, run: EngineRun) -> None:
        self.settings = settings
        """The `engine` node (engine/settings.py); its keys were checked when it was made."""
        self.model_path, self.seed, self.max_context_len = run.model_path, run.seed, run.max_context_len
        self.device, self.dtype, self.max_batch_size = settings.device, settings.dtype, settings.max_batch_size
        self.default_stop_token_ids: tuple[int, ...] = ()
        """Token ids that end every generation besides the request's own (the SGLang-wire fake sets its EOS)."""
        # On a CPU, bfloat16 decoding is about 25% faster with `eager` (batched matmuls) than with `sdpa`, and
        # `grouped` (models/attention.py) saves another 10% (SmolLM2-135M).
        check_implementation("engine.attn_implementation", settings.attn_implementation)
        self.threads, self.kv_cache_mb = settings.threads, settings.kv_cache_mb
        self.attn_implementation = settings.attn_implementation
        self.weight_version = 0
        self.stats: dict[str, float] = {"steps": 0, "prefills": 0, "tokens": 0, "max_batch": 0, "prefill_passes": 0,
                                        "prefill_tokens": 0, "cached_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self._reported = dict(self.stats)
        self._model: torch.nn.Module | None = None
        self._tokenizer: Any = None
        self.vision: Vision | None = None
        """The model's image processor for the turn service; None for text-only models (set by `start`)."""
        self._scheduler: _Scheduler | None = None
        self._thread: threading.Thread | None = None
        self._counter = itertools.count()
        self._closed = False
        self.programs = ProgramAdmission.built(settings.program_part, lambda: self.weight_version)

    @property
    def model(self) -> torch.nn.Module:
        """The loaded causal LM (read-only use outside the engine; load weights via update_weights)."""
        if self._model is None:
            raise RuntimeError("HFEngine has no model: call `await engine.start()` first")
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The tokenizer loaded from `model_path`."""
        if self._tokenizer is None:
            raise RuntimeError("HFEngine has no tokenizer: call `await engine.start()` first")
        return self._tokenizer

    async def start(self) -> None:
        """Load model and tokenizer off the event loop, then start the worker thread."""
        if self._thread is not None:
            return
        if self.threads:
            torch.set_num_threads(self.threads)
        model, tokenizer = await asyncio.to_thread(_load, self.model_path, self.device, self.dtype,
                                                   self.attn_implementation)
        self.vision = await asyncio.to_thread(Vision.load, self.model_path)
        self._model, self._tokenizer = model, tokenizer
        if self.programs is not None:
            self.programs.watch(hf_capacity_tokens(model, self.kv_cache_mb * 2**20))
        self._scheduler = _Scheduler(self, model, tokenizer)
        self._thread = threading.Thread(target=self._scheduler.run, name="hf-engine", daemon=True)
        self._thread.start()
        if is_adapter_folder(self.model_path):
            adapter = AdapterWeights(DEFAULT_ADAPTER, read_adapter_config(self.model_path),
                                     adapter_tensors(self.model_path))
            await self.update_adapter(adapter, 0)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None,
                       adapter: str | None = None) -> GenerateResult:
        """Generate a continuation of `input_ids` (placeholders unexpanded, one per image of `media`) with LoRA
        `adapter` (None: `DEFAULT_ADAPTER` once loaded, else the base weights; `BASE`: the base weights);
        batched with every other request in flight (with engine.admission=program once its session is admitted)."""
        call = lambda: self._generate(input_ids, sampling, rid, media, adapter)  # noqa: E731
        return await (call() if self.programs is None else self.programs.generate(call, input_ids, sampling, rid,
                                                                                  session_id))

    async def _generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                        media: Sequence[ImageFeatures] | None, adapter: str | None = None) -> GenerateResult:
        request = self._request(input_ids, sampling, rid, tuple(media or ()))
        request.adapter = adapter
        if request.limit <= 0:
            return request.result("length", self.weight_version)
        self._post(lambda s: s.submit(request))
        try:
            return await request.future
        except asyncio.CancelledError:
            if not self._closed:
                self._post(lambda s: s.abort(rid, lambda _: None))
            raise

    async def abort(self, rid: str) -> GenerateResult | None:
        """Abort `rid` at the next step boundary; None when it is unknown or already finished."""
        if self.programs is not None and (waiting := self.programs.abort(rid)) is not None:
            return waiting
        loop = asyncio.get_running_loop()
        future: asyncio.Future[GenerateResult | None] = loop.create_future()
        self._post(lambda s: s.abort(rid, lambda r: _resolve(loop, future, r)))
        return await future

    in_flight_updates = False
    """Generations are aborted around a weight update (`Engine.in_flight_updates`)."""

    async def close_session(self, session_id: str) -> None:
        """Ends the session's admission lease (engine.admission=program); no KV is kept per agent session."""
        if self.programs is not None:
            self.programs.end(session_id)

    def step_metrics(self) -> dict[str, float]:
        """The work since the last call, as `engine/...` metrics: worker seconds in prefill and decode, prompt
        tokens prefilled and taken from the prefix cache, decode steps and generated tokens."""
        now = dict(self.stats)
        delta = {key: now[key] - self._reported[key] for key in STEP_METRICS}
        self._reported = now
        metrics = self.programs.take_metrics() if self.programs is not None else {}
        return metrics | {f"engine/{name}": float(delta[key]) for key, name in STEP_METRICS.items()}

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load `state_dict` between two decode steps and serve it as `version`.

        Keys must exist in the model (a subset is fine). Do not modify the tensors until this returns.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._post(lambda s: _resolve(loop, future, _call(s.load_weights, state_dict, version)))
        await future

    async def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Load LoRA `adapter` (its layers put in by PEFT the first time its name is seen, engine/hf/adapters.py)
        between two decode steps and serve it as `version`; that adapter's prefix cache is cleared."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._post(lambda s: _resolve(loop, future, _call(s.load_adapter, adapter, version)))
        await future

    async def close(self) -> None:
        """Abort everything in flight, stop the worker thread and drop the model."""
        if self._closed:
            return
        self._closed = True  # refuse new commands before the worker's last drain
        if self._scheduler is not None and self._thread is not None:
            self._scheduler.commands.put(self._scheduler.stop)
            await asyncio.to_thread(self._thread.join)
        self._scheduler, self._thread, self._model = None, None, None
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _request(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                 media: tuple[ImageFeatures, ...]) -> Request:
        """Validate a generate call and build its request record (prompt expanded when it has images)."""
        self._live_scheduler()
        prompt = tuple(int(i) for i in input_ids)
        if media:
            prompt = self._expanded(prompt, media)
        if not prompt:
            raise ValueError("input_ids is empty: the prompt needs at least one token")
        if len(prompt) > self.max_context_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than max_context_len={self.max_context_len}; "
                "shorten the history or raise rollout.max_context_len"
            )
        check_sampling(sampling)
        self._check_vocab(prompt)
        seed = sampling.seed if sampling.seed is not None else derive_seed(self.seed, next(self._counter))
        loop = asyncio.get_running_loop()
        return Request(
            rid=rid,
            prompt=prompt,
            sampling=sampling,
            stop_ids=frozenset(sampling.stop_token_ids) | frozenset(self.default_stop_token_ids),
            limit=min(sampling.max_new_tokens, self.max_context_len - len(prompt)),
            generator=make_generator(seed, self.device),
            loop=loop,
            future=loop.create_future(),
            media=media,
        )

    def _expanded(self, prompt: tuple[int, ...], media: tuple[ImageFeatures, ...]) -> tuple[int, ...]:
        if self.vision is None:
            raise ValueError(f"model {self.model_path} is text-only: generate got {len(media)} image(s)")
        return tuple(expand_placeholders(prompt, self.vision.image_token_id, media))

    def _check_vocab(self, prompt: tuple[int, ...]) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab}); got ids {min(prompt)}..{max(prompt)}")

    def _live_scheduler(self) -> _Scheduler:
        if self._closed:
            raise RuntimeError("HFEngine is closed")
        if self._scheduler is None:
            raise RuntimeError("HFEngine is not running: call `await engine.start()` first")
        return self._scheduler

    def _post(self, command: Callable[[_Scheduler], None]) -> None:
        """Queue `command` for the worker thread; it runs at the next step boundary."""
        scheduler = self._live_scheduler()
        scheduler.commands.put(lambda: command(scheduler))
