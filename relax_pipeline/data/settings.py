"""The `dataset` node as records, one per kind of `dataset=` option, declared once.

`JsonlSettings` reads prompts from a JSONL file (`dataset=digits`, `toy`, the examples); `ArithSettings`
generates arithmetic problems with a fixed held-out split (`dataset=arith`). Each names its class in
`_target_`. Eval datasets (`eval.datasets[i]`) are built from the run's own dataset record with the entry's
path and keys put in (`with_source`), so an eval entry reads the same way the train data does.

What it does not do: read files or generate problems (data/dataset.py, data/arith.py do).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class JsonlSettings:
    """`dataset=digits|toy`: prompts from a JSONL file; connects the config to `JsonlDataset`."""

    path: str
    """JSONL file, one prompt per line."""
    _target_: str = "relax_pipeline.data.dataset.JsonlDataset"
    """The dataset class this node builds."""
    input_key: str = "input"
    """Row key holding the prompt: a string (one user message) or a message list."""
    metadata_key: str | None = "metadata"
    """Row key passed to the agent as input metadata."""
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """Media kind → row key of the row's list of sources; only `image` (one `<image>` placeholder per image;
    add it with `+dataset.multimodal_keys.image=images`)."""
    shuffle: bool = True
    """Shuffle prompt order each epoch with `seed`."""


@dataclass
class ArithSettings:
    """`dataset=arith`: generated arithmetic problems with a fixed held-out split (data/arith.py)."""

    _target_: str = "relax_pipeline.data.arith.ArithDataset"
    """The dataset class this node builds."""
    split: str = "train"
    """Which split the run trains on: `train`, `validation` or `heldout` (eval entries choose theirs with
    `path: arith:<split>`)."""
    operations: list[str] = field(default_factory=lambda: ["+"])
    """Operations drawn from: `+`, `-`, `*`."""
    low: int = 0
    """Smallest operand."""
    high: int = 99
    """Largest operand (0-99: one- and two-digit numbers)."""
    heldout_size: int = 200
    """Problems in the held-out split; it depends only on seed, operations, low, high and this size."""
    validation_size: int = 0
    """Problems in the validation split: drawn from outside the held-out split and left out of the train split.
    Choose settings on it (`path: arith:validation`) and keep the held-out split for reporting."""
    train_size: int | None = None
    """Problems in the train split, none of them held out or validation; None: every other problem."""
    seed: int = 0
    """Seed of the problem set, independent of the run's `seed` (every run sees the same held-out problems)."""
    steps: list[int] | None = None
    """Chained problems (data/chains.py): the calculator calls a problem needs, cycled over each split's problems
    (`[1, 2, 3]`: equal thirds); None: one `a op b` problem each, the whole space enumerated."""
    train_steps: list[int] | None = None
    """The train split's own mix of calls needed (the curriculum, `[1, 2, 2, 3]`); None: `steps`."""
    train_given: bool = False
    """Chained train problems come with their first 0..k-1 of k calls already made by the environment's own
    calculator (`metadata.given`, drawn with `seed`; the agent shows them as prompt, so they train no token); eval
    splits never do."""
    prompt: str = "What is {a} {op} {b}? Answer with just the number."
    """Prompt text; `{a}`, `{op}` and `{b}` (single problems) or `{expression}` (both) are filled in. The answer
    goes to the row's `metadata.answer`."""
    path: str | None = None
    """None generates; `arith:<split>` selects a split; any other path is read as JSONL (what eval entries pass)."""
    input_key: str = "input"
    """Row key of the prompt when `path` is a JSONL file."""
    metadata_key: str | None = "metadata"
    """Row key of the metadata when `path` is a JSONL file."""
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """As `dataset.multimodal_keys`, when `path` is a JSONL file."""
    shuffle: bool = True
    """Shuffle prompt order each epoch with the run's `seed`."""

    def jsonl(self) -> JsonlSettings:
        """The JSONL reading of `path` (a file, not an `arith:<split>`)."""
        assert self.path is not None
        return JsonlSettings(self.path, input_key=self.input_key, metadata_key=self.metadata_key,
                             multimodal_keys=dict(self.multimodal_keys), shuffle=self.shuffle)


DatasetSettings = JsonlSettings | ArithSettings
"""Any `dataset=` node."""


def with_source(settings: DatasetSettings, source: dict[str, Any]) -> DatasetSettings:
    """`settings` reading `source` (an eval entry's path, input_key, metadata_key, multimodal_keys) in file order."""
    return replace(settings, **source, shuffle=False)
