"""Credit records: one group's exported contexts as every `credit=` option sees them, and nothing else.

The Reward stage builds a `CreditGroup` from a finished group (session order, then export order, the
final export metadata and the session's input already looked up), hands it to the configured credit, and
copies the result back; credit code never reaches into stage objects, sessions or agent outputs. A
context's `slot` is its session's position in the group, which is what the advantage hook's
`metadata_by_slot` is indexed by.

A context's credit lives on its sample: `CreditContext.advantage` reads and sets `sample.advantage` (setting
replaces the frozen sample), so a credited context's `sample` is the row the trainer trains on as it is, with
no copy into another record.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from relax_pipeline.forest.sample import Sample


@dataclass
class CreditContext:
    """One exported context with its credit; connects the Reward stage to credit and Transfer (its credited
    `sample` is the trainer's row)."""

    slot: int
    """Position of the exporting session in its group."""
    session_id: str
    name: str | None
    """Export name; None for the implicit export."""
    sample: Sample
    metadata: dict[str, Any]
    """The context's final metadata: its record's, or the session's for an implicit export."""
    prompt: dict[str, Any]
    """The session's input payload (`{"messages", "metadata"}`)."""
    reward_object: Any = None
    """The reward as exported or scored (a number, an object or None)."""
    reward: float | None = None
    """The primary scalar (`credit.reward_key` of an object)."""
    branch: int | None = None
    """Which chain of a forked session's implicit export (they share the session's credit); None otherwise."""
    truncated_failure: bool = False
    """The agent failed after our length limit cut its last turn: without a reward it gets
    `credit.truncated_reward` (a reward model, when configured, scores it first)."""
    exported_reward: Any = field(init=False, default=None)
    """`reward_object` as the context was made (what the agent exported), kept while credit fills in
    `reward_object`: the credit's input, which a replay bundle records (`relax_pipeline/replay/`)."""

    def __post_init__(self) -> None:
        self.exported_reward = copy.deepcopy(self.reward_object)

    @property
    def advantage(self) -> float | None:
        """The base scalar credit, before token expansion and whitening (the sample's `advantage`)."""
        return self.sample.advantage

    @advantage.setter
    def advantage(self, value: float | None) -> None:
        self.sample = replace(self.sample, advantage=value)

    @property
    def unit(self) -> tuple[int, str | None]:
        """What gets one share of the group's credit: one export of one session (its chains share it)."""
        return self.slot, self.name

    def sample_dict(self) -> dict[str, Any]:
        """What a reward model or filter sees of this context (copies: user code cannot change the dump)."""
        return {
            "name": self.name,
            "messages": [m.to_openai() for m in self.sample.messages],
            "metadata": copy.deepcopy(self.metadata),
            "prompt": copy.deepcopy(self.prompt),
            "reward": copy.deepcopy(self.reward_object),
        }


@dataclass
class CreditGroup:
    """One group's contexts; connects the Reward stage to a `credit=` option."""

    id: str
    mode: str
    """"train" or "eval"."""
    slots: int
    """Sessions in the group."""
    contexts: list[CreditContext] = field(default_factory=list)
    filtered: str | None = None
    """Why the credit filtered the group (set by `credit.base.filter_group`), None when it is kept."""
