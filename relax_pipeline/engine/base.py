"""The inference engine contract shared by the gateway, the runtime modes and the trainer.

An engine turns prompt token ids into generated token ids, token in and token out: it never sees
text and never re-tokenizes. Each result carries the logprob of every sampled token, computed the way
the trainer computes it (log-softmax of logits / temperature over the full vocabulary, before any
top-p/top-k truncation), and the weight version that produced it, so off-policy corrections can be
applied per token.

Vision-language models also take `media`: the processed images of the prompt, in order, one per image
placeholder token in `input_ids` (placeholders unexpanded). The engine expands each placeholder to the
image's `tokens` copies (`expand_placeholders`) and feeds the pixels; context limits count the expanded
length. Text-only engines accept `media=None` only.

This module holds only records and the `Engine` protocol, which lists every member its callers use (the
turn service, the step loop, the run's builder), so none of them probes an engine with `getattr`; an
engine without a part answers None (`vision`) or nothing (`step_metrics`). `hf/` (embedded transformers)
and `sglang/` implement it; `relax_pipeline.testing` holds the scripted engines used by protocol tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

from relax_pipeline.canonical.form import Image

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one generation, from the training config plus the request's limits.

    Connects the gateway (which fills it) to the engine (which obeys it); the forest records it per
    response node so the trainer can correct for truncated sampling.
    """

    max_new_tokens: int
    """Upper bound on generated tokens; generation ends with finish_reason "length" when reached."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (logprobs are then taken at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 disables it."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded output contains one (finish_reason "stop")."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (the template's end-of-turn and eos); the id itself is kept."""
    seed: int | None = None
    """Per-request sampling seed; None draws from the engine's generator."""
    stop_context: tuple[int, ...] = ()
    """Ids this generation continues (a preempted generation's output so far, already at the end of the input
    ids): stop strings are matched across them and the new ids, so a stop split by the abort still ends it."""


@dataclass(frozen=True)
class GenerateResult:
    """What one generation produced; connects the engine to the forest's response node."""

    output_ids: tuple[int, ...]
    """Generated token ids exactly as sampled, including a final stop token id when one ended it."""
    logprobs: tuple[float, ...]
    """Logprob of each generated token under the sampling temperature, full vocabulary."""
    finish_reason: FinishReason
    """"stop" (stop token or stop string), "length" (max_new_tokens) or "abort" (aborted)."""
    weight_version: int
    """Version of the weights that generated these tokens."""
    matched_stop: str | int | None = None
    """The stop string or stop token id that ended generation, if any."""
    weight_versions: tuple[int, ...] = field(default=())
    """Per-token versions when a resumed generation spans weight updates; empty means all equal."""
    abort_count: int = 0
    """Times this generation was aborted and resumed (partial rollout) before it finished."""
    first_token_s: float | None = None
    """Seconds from the engine taking the request to its first token (its admission wait and prefill); None when
    the engine does not measure it. The session traces split prefill from decode with it."""

    @property
    def token_versions(self) -> tuple[int, ...]:
        """The weight version of every generated token (expanding the all-equal shorthand)."""
        return self.weight_versions or (self.weight_version,) * len(self.output_ids)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends only on `parts` (for example run seed, rollout, prompt, sample; or engine seed
    and request counter), never on timing or on other requests. The one seed-mixing rule of the package."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


def varying(versions: tuple[int, ...]) -> tuple[int, ...]:
    """`versions` for `GenerateResult.weight_versions`: kept when they differ, () when all are equal."""
    return versions if len(set(versions)) > 1 else ()


def resume_input(prompt_ids: Sequence[int], sampling: SamplingParams, done: GenerateResult | None
                 ) -> tuple[Sequence[int], SamplingParams]:
    """Prompt and sampling of a preempted generation's next piece: its partial tokens appended (and given as the
    stop strings' context), the remaining token budget, a seed derived from the tokens done."""
    if done is None:
        return prompt_ids, sampling
    seed = None if sampling.seed is None else derive_seed(sampling.seed, len(done.output_ids))
    left = max(sampling.max_new_tokens - len(done.output_ids), 1)
    return [*prompt_ids, *done.output_ids], replace(sampling, max_new_tokens=left, seed=seed,
                                                        stop_context=tuple(done.output_ids))


def joined(first: GenerateResult | None, more: GenerateResult) -> GenerateResult:
    """One result from a preempted generation and its continuation; every token keeps its version."""
    if first is None:
        return more
    return GenerateResult(first.output_ids + more.output_ids, first.logprobs + more.logprobs, more.finish_reason,
                          more.weight_version, more.matched_stop, varying(first.token_versions + more.token_versions),
                          first.abort_count)


@dataclass(frozen=True)
class ImageFeatures:
    """One image processed for a vision-language model; connects the turn service's vision step to the
    engine (prefill), the forest (observation nodes) and the trainer (`multimodal_train_inputs`)."""

    pixel_values: Any
    """Float tensor [patches, channels * temporal_patch * patch * patch], as the image processor made it."""
    grid_thw: tuple[int, int, int]
    """Patch grid (temporal, height, width) before spatial merging."""
    tokens: int
    """Placeholder tokens the image takes once expanded: t * h * w / merge_size**2."""
    digest: bytes = b""
    """Digest of the image's URL (its identity in the forest)."""


def expand_placeholders(ids: Sequence[int], token_id: int, media: Sequence[ImageFeatures]) -> list[int]:
    """`ids` with the k-th `token_id` repeated `media[k].tokens` times; the counts must agree."""
    positions = [i for i, t in enumerate(ids) if t == token_id]
    if len(positions) != len(media):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens (id {token_id}) for "
                         f"{len(media)} images; image placeholder tokens may not appear in text")
    out: list[int] = []
    start = 0
    for position, image in zip(positions, media, strict=True):
        out.extend(ids[start:position])
        out.extend([token_id] * image.tokens)
        start = position + 1
    out.extend(ids[start:])
    return out


DEFAULT_ADAPTER = "default"
"""The adapter name of the run's one policy (PEFT's default name too): an engine serves the adapter of this name to
every request that names no adapter."""


@dataclass(frozen=True)
class AdapterWeights:
    """One LoRA adapter as the trainer hands it over; connects the trainer's weight sync (`trainer.lora`) to the
    engine (`Engine.update_adapter`)."""

    name: str
    """The adapter's name: `DEFAULT_ADAPTER` for the run's policy (several policies: one name each)."""
    config: dict[str, Any]
    """PEFT's `LoraConfig` as a plain dict (what `adapter_config.json` holds: r, lora_alpha, target_modules...)."""
    tensors: dict[str, Any]
    """The adapter's tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`), on the CPU."""


class ImageProcessor(Protocol):
    """A vision-language model's image processing (`engine/vision.py`'s `Vision`), as the turn service uses it."""

    image_token_id: int
    """The placeholder token one image takes in inference ids (before expansion)."""

    def features(self, image: Image) -> ImageFeatures:
        """The processed image (cached by its digest)."""


@runtime_checkable
class Engine(Protocol):
    """Async token-in/token-out generation with abort and weight updates."""

    weight_version: int
    """Version of the weights being served (the trainer's step that produced them)."""
    max_context_len: int
    """Longest prompt plus generation the engine accepts, in (expanded) tokens."""
    max_batch_size: int
    """Most generations the engine runs at once (`engine.max_batch_size`); more wait in its queue."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (the chat template renders and parses with it); set once started."""

    @property
    def vision(self) -> ImageProcessor | None:
        """The model's image processing; None for a text-only model (images are then refused with a 400)."""

    def step_metrics(self) -> dict[str, float]:
        """`engine/<name>` metrics of the step that just ended (empty when the engine keeps none)."""

    async def start(self) -> None:
        """Load weights and start any worker; called once before the first generate."""

    @property
    def in_flight_updates(self) -> bool:
        """Whether running generations go on through `update_weights` (paused in place, engine=sglang with
        engine.weight_update=pause), so a runtime need not abort them first."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        """Generate a continuation of `input_ids` (with the prompt's images, if any); concurrent calls are
        batched by the engine. `session_id` names the agent session the turn belongs to (an engine that keeps a
        session's KV, engine=sglang with engine.sessions, continues it; the others ignore it)."""

    async def close_session(self, session_id: str) -> None:
        """The agent session `session_id` ended: release what the engine keeps for it (nothing for most)."""

    async def abort(self, rid: str) -> GenerateResult | None:
        """Stop generation `rid` now; its `generate` call returns the partial output with "abort"."""

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights between generations and serve them as `version`."""

    async def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Load (or replace) LoRA adapter `adapter.name` over the base weights between generations and serve it as
        `version`; requests that name no adapter get `DEFAULT_ADAPTER` once it is loaded."""

    async def close(self) -> None:
        """Stop workers and free memory."""
