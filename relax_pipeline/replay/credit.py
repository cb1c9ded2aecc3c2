"""The credit stage of a replay: a bundle's scored groups rebuilt as `CreditGroup`s and scored again.

`rebuild_groups` turns `credit.jsonl` (with the rows it points at) back into the records the Reward stage handed
the credit: each context with its sample (tokens, masks, logprobs, versions, messages), final metadata, the
session's input and the reward as the agent exported it. `rescore` runs the configured credit on them as the
Reward stage does (`score`, then `keep`), with a failure recorded on the group instead of raised. `compare`
lines the replayed rewards, advantages and filters up against the recorded ones; floats are compared bit for bit
(the credit is plain Python arithmetic on the same inputs, so an unchanged credit gives identical numbers).

What it does not do: read the config or build the credit class (`job.py`), or train (`loss.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import CanonicalError, parse_messages
from relax_pipeline.credit.base import Credit, filter_group
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.forest.sample import Sample


@dataclass
class Replayed:
    """One recorded group and its replay; connects the bundle's credit lines to the comparison."""

    recorded: dict[str, Any]
    """The group's `credit.jsonl` line."""
    group: CreditGroup
    """The group as replayed (its contexts scored again)."""
    failed: str | None = None
    """Why the replayed credit failed on the group (it then trains nothing), None when it scored."""

    @property
    def trains(self) -> bool:
        """Whether the replayed group yields training rows (the recorded run did not drop it later)."""
        return not (self.failed or self.group.filtered or self.recorded.get("dropped"))


@dataclass(frozen=True)
class ContextDiff:
    """One context's credit, recorded against replayed."""

    group_id: str
    slot: int
    name: str | None
    branch: int | None
    reward: tuple[float | None, float | None]
    advantage: tuple[float | None, float | None]

    @property
    def key(self) -> Key:
        return self.group_id, self.slot, self.name, self.branch

    @property
    def identical(self) -> bool:
        return same(*self.reward) and same(*self.advantage)


def same(a: float | None, b: float | None) -> bool:
    """Bit-exact equality of two optional floats (NaN equals NaN)."""
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def to_sample(fields: dict[str, Any]) -> Sample:
    """A sample from a dump row or a bundle's inline sample (the fields credit and the trainer read)."""
    try:
        messages = parse_messages(fields.get("messages") or [])
    except CanonicalError:
        messages = ()  # a message the canonical form cannot read back (an image by reference): credit sees none
    return Sample(tuple(fields["tokens"]), int(fields["prompt_length"]), tuple(fields["loss_mask"]),
                  tuple(float(x) for x in fields["rollout_logprobs"]), tuple(fields.get("weight_versions") or ()),
                  messages, truncated=bool(fields.get("truncated", False)))


def rebuild_groups(lines: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[Replayed]:
    """The recorded groups as unscored `CreditGroup`s, in the order the step had them."""
    return [Replayed(line, CreditGroup(line["group_id"], line["mode"], int(line["slots"]),
                                       [_context(c, rows) for c in line["contexts"]])) for line in lines]


def _context(line: dict[str, Any], rows: Sequence[dict[str, Any]]) -> CreditContext:
    fields = rows[line["row"]] if line.get("row") is not None else line["sample"]
    return CreditContext(int(line["slot"]), line["session_id"], line["name"], to_sample(fields), line["metadata"],
                         line["prompt"], line["exported_reward"], branch=line["branch"],
                         truncated_failure=bool(line["truncated_failure"]))


async def rescore(credit: Credit, groups: Sequence[Replayed]) -> None:
    """Score every group as the Reward stage does; a failure is kept on the group (named like the stage does)."""
    for replayed in groups:
        try:
            await credit.score(replayed.group)
            if not replayed.group.filtered and not await credit.keep(replayed.group):
                filter_group(replayed.group, "credit.filter_path rejected the group")
        except Exception as error:  # noqa: BLE001 - user code: the replay reports it and goes on
            replayed.failed = f"{type(error).__name__}: {error}"


def compare(groups: Sequence[Replayed]) -> list[ContextDiff]:
    """Every context's recorded and replayed reward and advantage, in step order."""
    out = []
    for replayed in groups:
        for line, context in zip(replayed.recorded["contexts"], replayed.group.contexts, strict=True):
            out.append(ContextDiff(replayed.group.id, context.slot, context.name, context.branch,
                                   (line["reward"], context.reward), (line["advantage"], context.advantage)))
    return out


def filter_changes(groups: Sequence[Replayed]) -> list[str]:
    """One line per group whose filtered or failed state differs from the recording."""
    out = []
    for replayed in groups:
        before, after = replayed.recorded.get("filtered"), replayed.failed or replayed.group.filtered
        if (before is None) != (after is None):
            out.append(f"group {replayed.group.id}: recorded {before or 'kept'}, replayed {after or 'kept'}")
    return out


Key = tuple[str, int, str | None, int | None]
"""A context's identity in a step: group id, slot, export name, branch."""


def train_rows(groups: Sequence[Replayed]) -> list[tuple[Key, Sample]]:
    """The replayed trainer batch: credited samples of the groups that train, in step order (the loop's rule)."""
    return [((r.group.id, c.slot, c.name, c.branch), c.sample) for r in groups if r.trains
            for c in r.group.contexts if c.advantage is not None]
