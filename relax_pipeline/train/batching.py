"""Training samples and how a rollout batch is cut into optimizer steps and micro-batches.

`TrainSample` is the trainer's input record: one exported context as tokens with its response-aligned
loss mask, rollout logprobs and base advantage. `BatchSettings` is the `trainer.batching` node.
`global_batches` splits a rollout batch into optimizer steps of `global_batch_size` samples in the given
order (None: one step; a short remainder is its own, smaller step, never dropped). `micro_batches` packs
one global batch into forward/backward passes: fixed-size chunks in order, or, with dynamic batching,
first-fit-decreasing by token count.

The dynamic budget counts PADDED tokens (`rows × longest row`), because the backends run right-padded
[B, L] batches: that is what a forward pass really costs in memory. Samples are placed longest first
(ties keep their input order), each into the first micro-batch where it fits, so the result is
deterministic. A sample longer than the budget gets a micro-batch of its own and a warning; nothing is
ever dropped.

Samples of vision-language models carry `multimodal_train_inputs` (`pixel_values`, `image_grid_thw`);
their `tokens` are the processor-expanded ids, so the padded-token budget counts image tokens too.

What this module does not do: tensors, padding, normalizers (see `step.py`), or data-parallel sharding
across ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class BatchSettings:
    """The `trainer.batching` node; connects the `trainer` config group to `global_batches`/`micro_batches`.

    Not frozen: OmegaConf turns frozen dataclasses into read-only nodes, which overrides could not change.
    """

    global_batch_size: int | None = None
    """Samples per optimizer step; None means one optimizer step over the whole rollout batch."""
    micro_batch_size: int = 8
    """Samples per forward/backward when dynamic batching is off."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by token count (required when a session exports several contexts)."""
    max_tokens_per_gpu: int = 8192
    """Token budget of one packed micro-batch under dynamic batching."""

    def __post_init__(self) -> None:
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            raise ValueError(f"trainer.batching.global_batch_size={self.global_batch_size}; "
                             "use null or a positive number")
        for key in ("micro_batch_size", "max_tokens_per_gpu"):
            if getattr(self, key) <= 0:
                raise ValueError(f"trainer.batching.{key}={getattr(self, key)}; use a positive number")


@dataclass(frozen=True)
class TrainSample:
    """One exported context as the trainer sees it; connects the credit stage to a trainer backend.

    `loss_mask` and `rollout_logprobs` have one entry per response token (`response_length` of them);
    `advantage` is the base scalar credit, expanded over tokens by the trainer.
    """

    tokens: tuple[int, ...]
    """Prompt + response token ids, exactly as recorded."""
    prompt_length: int
    """Number of leading prompt tokens (at least 1: the first response token needs a predecessor)."""
    loss_mask: tuple[int, ...]
    """1 on generated tokens, 0 on observation tokens; one per response token."""
    rollout_logprobs: tuple[float, ...]
    """The engine's logprob of each response token (0.0 on observations)."""
    advantage: float
    """Base scalar credit of the context (before token expansion and whitening)."""
    weight_versions: tuple[int, ...] = ()
    """Weight version per response token; informational, the loss does not use it."""
    multimodal_train_inputs: dict[str, Any] | None = None
    """`pixel_values` and `image_grid_thw` tensors of the sample's images, in order; None for text."""

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_length <= len(self.tokens):
            raise ValueError(f"TrainSample.prompt_length={self.prompt_length} must be in [1, {len(self.tokens)}]")
        size = self.response_length
        for name in ("loss_mask", "rollout_logprobs"):
            if len(getattr(self, name)) != size:
                raise ValueError(
                    f"TrainSample.{name} has {len(getattr(self, name))} entries; response_length is {size}"
                )

    @property
    def response_length(self) -> int:
        """Tokens after the prompt."""
        return len(self.tokens) - self.prompt_length


def global_batches(samples: Sequence[TrainSample], batching: BatchSettings) -> list[list[TrainSample]]:
    """Optimizer steps in input order: chunks of `global_batch_size` (None: one step of everything)."""
    if batching.global_batch_size is None:
        return [list(samples)] if samples else []
    return _chunks(samples, batching.global_batch_size)


def micro_batches(samples: Sequence[TrainSample], batching: BatchSettings) -> list[list[TrainSample]]:
    """Pack one global batch into micro-batches: fixed-size chunks, or FFD by padded token count."""
    if not batching.use_dynamic_batch_size:
        return _chunks(samples, batching.micro_batch_size)
    return _first_fit_decreasing(samples, batching.max_tokens_per_gpu)


def padded_tokens(samples: Sequence[TrainSample]) -> int:
    """Tokens a right-padded [B, L] batch of `samples` holds: rows × longest row."""
    return len(samples) * max((len(s.tokens) for s in samples), default=0)


def _chunks(samples: Sequence[TrainSample], size: int) -> list[list[TrainSample]]:
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


def _first_fit_decreasing(samples: Sequence[TrainSample], budget: int) -> list[list[TrainSample]]:
    """Longest first (stable), each into the first bin whose padded size stays within `budget`."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    bins: list[list[TrainSample]] = []
    for index in order:
        sample = samples[index]
        target = next((b for b in bins if _fits(b, sample, budget)), None)
        if target is None:
            _warn_if_oversized(sample, index, budget)
            bins.append([sample])
        else:
            target.append(sample)
    return bins


def _fits(bin_: list[TrainSample], sample: TrainSample, budget: int) -> bool:
    """Bins are filled longest first, so a bin's first sample is its longest row."""
    longest = max(len(bin_[0].tokens), len(sample.tokens))
    return (len(bin_) + 1) * longest <= budget


def _warn_if_oversized(sample: TrainSample, index: int, budget: int) -> None:
    if len(sample.tokens) > budget:
        log.warning(
            "sample %d has %d tokens, more than trainer.batching.max_tokens_per_gpu=%d; it trains in a micro-batch "
            "of its own",
            index,
            len(sample.tokens),
            budget,
        )
