"""Lineage → training sample: the one token-exact record of a context, from the forest through credit to the
trainer's collate.

A sample is the path from a root to one exported node. Its prompt is every token before the first
generated token; its response is everything after, with loss 1 exactly on generated tokens and 0 on
observation tokens (tool results, template glue), whose logprob is 0.0. Every response position
carries a weight version: the producing version on generated tokens, and on observation tokens the
version of the latest generated token before them. This module does not assign credit.

With images (vision-language models) a sample holds the training view: each observation's
processor-expanded ids (every image placeholder repeated once per image token; loss 0, logprob 0.0) and
`multimodal_train_inputs`, the `pixel_values` and `image_grid_thw` of the lineage's images concatenated
in order, ready for the model's forward. Text samples carry None there.

Sample fields are tuples of plain values: a sample is built once per exported context and dropped after
the step, while the forest's nodes keep the compact arrays for the session's life (the sizes and the build
time are on docs/benchmarks.md, "Gateway").

Credit sets `advantage` (the base scalar, `dataclasses.replace` through `CreditContext.advantage`); a sample
with an advantage is a training row, and it checks its lengths when made (`prompt_length` in [1, len(tokens)],
one loss-mask entry and one logprob per response token), so a malformed row fails where it is made, naming
the field. A row needs only its tokens, masks, logprobs and advantage: the fields that say where it came from
(messages, context, hash, counts, timings) default to empty, as in the lean copy `train/data_parallel.py`
ships to worker ranks and in tests that build rows by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import Context, Message
from relax_pipeline.engine.base import ImageFeatures
from relax_pipeline.forest.store import Node, SessionForest, TurnTiming


@dataclass(frozen=True)
class Sample:
    """One exported context as tokens; connects the forest to credit, the dump and the trainer (its collate)."""

    tokens: tuple[int, ...]
    """Prompt + response token ids, exactly as recorded."""
    prompt_length: int
    """Leading prompt tokens (at least 1 in a training row: the first response token needs a predecessor)."""
    loss_mask: tuple[int, ...]
    """1 on generated tokens, 0 on observation tokens; one per response token."""
    rollout_logprobs: tuple[float, ...]
    """The engine's logprob of each response token (0.0 on observations)."""
    weight_versions: tuple[int, ...] = ()
    """Weight version per response token; informational, the loss does not use it."""
    messages: tuple[Message, ...] = ()
    context: Context = Context()
    """The tree's tools and template kwargs (the empty `Context()`, one shared instance, by default)."""
    state_hash: str = ""
    turn_count: int = 0
    truncated: bool = False
    """The last generated turn stopped at the length limit."""
    abort_count: int = 0
    multimodal_train_inputs: dict[str, Any] | None = None
    """`pixel_values` [patches, dim] and `image_grid_thw` [images, 3] tensors, or None without images."""
    image_grid_thw: tuple[tuple[int, int, int], ...] = ()
    """Patch grid per image, in order (a small summary for dumps)."""
    image_tokens: tuple[int, ...] = ()
    """Expanded placeholder tokens per image, in order."""
    turn_timings: tuple[TurnTiming | None, ...] = ()
    """Queue, generation and total time of each generated turn of the lineage, in order (None: not measured)."""
    advantage: float | None = None
    """The base scalar credit (before token expansion and whitening); None until credit gives one."""

    def __post_init__(self) -> None:
        if self.advantage is not None:
            check_lengths(self)

    @property
    def response_length(self) -> int:
        """Tokens after the prompt."""
        return len(self.tokens) - self.prompt_length


def check_lengths(sample: Sample) -> None:
    """Raise a ValueError naming the field when `sample`'s prompt length or per-response-token fields are off."""
    if not 1 <= sample.prompt_length <= len(sample.tokens):
        raise ValueError(f"Sample.prompt_length={sample.prompt_length} must be in [1, {len(sample.tokens)}]")
    size = sample.response_length
    for name in ("loss_mask", "rollout_logprobs"):
        if len(getattr(sample, name)) != size:
            raise ValueError(f"Sample.{name} has {len(getattr(sample, name))} entries; response_length is {size}")


def build_sample(forest: SessionForest, node: Node, shared: frozenset[int] = frozenset()) -> Sample:
    """Walk the lineage of `node` and lay out its tokens, masks, logprobs and versions.

    Generated tokens of the response nodes in `shared` (trained by an earlier chain of a forked session)
    keep their logprobs and versions but get loss 0, so each generated token is trained once."""
    path = forest.lineage(node)
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    prompt_length: int | None = None
    for step in path:
        if step.kind == "response" and prompt_length is None:
            prompt_length = len(tokens)
        tokens.extend(step.training_ids)
        if prompt_length is None:
            continue
        _extend_response(step, mask, logprobs, versions, step.id not in shared)
    responses = [s for s in path if s.kind == "response"]
    return Sample(
        tuple(tokens), len(tokens) if prompt_length is None else prompt_length, tuple(mask), tuple(logprobs),
        tuple(versions), tuple(m for s in path for m in s.messages), path[0].context or Context(),
        node.state_hash.hex(), len(responses), bool(responses) and responses[-1].finish_reason == "length",
        sum(s.abort_count for s in responses), *_multimodal([m for s in path for m in s.media]),
        tuple(s.timing for s in responses),
    )


def _multimodal(media: list[ImageFeatures]) -> tuple[Any, ...]:
    """`multimodal_train_inputs`, `image_grid_thw` and `image_tokens` of a lineage's images."""
    if not media:
        return None, (), ()
    import torch

    grids = tuple(m.grid_thw for m in media)
    inputs = {"pixel_values": torch.cat([m.pixel_values for m in media]), "image_grid_thw": torch.tensor(grids)}
    return inputs, grids, tuple(m.tokens for m in media)


def _extend_response(step: Node, mask: list[int], logprobs: list[float], versions: list[int],
                     trained: bool = True) -> None:
    n = len(step.training_ids)
    if step.kind == "response":
        mask.extend([int(trained)] * n)
        logprobs.extend(step.logprobs)
        versions.extend(step.weight_versions)
        return
    mask.extend([0] * n)
    logprobs.extend([0.0] * n)
    versions.extend([versions[-1] if versions else 0] * n)


def token_table(sample: Sample, tokenizer: object, width: int = 18) -> str:
    """Aligned rows of token text, loss mask, logprob and version, for reading tests and dumps."""
    rows = []
    for i, tid in enumerate(sample.tokens):
        text = repr(tokenizer.decode([tid], skip_special_tokens=False))[:width]  # type: ignore[attr-defined]
        j = i - sample.prompt_length
        extra = "-"
        if j >= 0:
            extra = f"{sample.loss_mask[j]}  {sample.rollout_logprobs[j]:9.4f}  v{sample.weight_versions[j]}"
        rows.append(f"{i:5d} {tid:6d} {text:<{width}} {extra}")
    return "\n".join(rows)
