"""The inference engine contract shared by the gateway, the runtime modes and the trainer.

An engine turns prompt token ids into generated token ids, token in and token out: it never sees
text and never re-tokenizes. Each result carries the logprob of every sampled token, computed the way
the trainer computes it (log-softmax of logits / temperature over the full vocabulary, before any
top-p/top-k truncation), and the weight version that produced it, so off-policy corrections can be
applied per token.

This module holds only records and the `Engine` protocol; `hf.py` (embedded transformers) implements
it, and `relax_pipeline.fakes` holds the scripted engine used by protocol tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

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


@runtime_checkable
class Engine(Protocol):
    """Async token-in/token-out generation with abort and weight updates."""

    weight_version: int
    max_context_len: int

    async def start(self) -> None:
        """Load weights and start any worker; called once before the first generate."""

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str) -> GenerateResult:
        """Generate a continuation of `input_ids`; concurrent calls are batched by the engine."""

    async def abort(self, rid: str) -> GenerateResult | None:
        """Stop generation `rid` now; its `generate` call returns the partial output with "abort"."""

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights between generations and serve them as `version`."""

    async def close(self) -> None:
        """Stop workers and free memory."""
