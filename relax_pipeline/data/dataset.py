"""Prompt datasets and the data source that feeds rollout groups.

`JsonlDataset` reads one prompt per line: `dataset.input_key` holds a string (one user message) or a
message list, `dataset.metadata_key` an optional object passed to the agent; a row may have either or both (a
metadata-only row suits an agent that reads its task from metadata). Rows are validated at load
time; an error names the file, the line and the key. `DataSource` hands out prompts in a seeded order
per epoch and takes back prompts whose group was dropped or filtered, serving them first from the next
step on, so an epoch still covers every prompt.

Images: `dataset.multimodal_keys` maps a media kind to the row key holding that row's list of sources
(only `{"image": "<key>"}` is supported). The prompt text (or its messages' contents) carries one `<image>`
placeholder per image, in order; a count mismatch, a missing local file or an unreadable source is a
load-time error naming the row. Relative paths are resolved against the dataset file's folder. Sources
stay as given on the `Prompt` (nothing is decoded or held in memory twice); `session_io.build_input`
turns them into data-URI `image_url` parts when the agent's input file is written.
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_pipeline.data.media import URL_PREFIXES, MediaError, count_placeholders, open_source, resolve_path
from relax_pipeline.data.settings import JsonlSettings

MEDIA_KINDS: tuple[str, ...] = ("image",)


@dataclass(frozen=True)
class Prompt:
    """One dataset row; connects the dataset to Prepare (which writes the agent's input file)."""

    index: int
    input: str | list[dict[str, Any]] | None
    """The task as one user message or a message list; None for a metadata-only row (the agent reads its
    task from the input file's `metadata`, and the input file has no `messages`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[Any, ...] = ()
    """Image sources for the `<image>` placeholders of `input`, in order (paths already absolute)."""


class JsonlDataset:
    """Prompts from a JSONL file."""

    def __init__(self, settings: JsonlSettings) -> None:
        self.path = Path(settings.path).expanduser()
        self.input_key = settings.input_key
        self.metadata_key = settings.metadata_key
        self.image_key = _image_key(dict(settings.multimodal_keys))
        self.shuffle = settings.shuffle
        self.prompts = self._load()

    def _load(self) -> list[Prompt]:
        if not self.path.is_file():
            what = "is a folder, not a file" if self.path.is_dir() else "does not exist"
            raise FileNotFoundError(f"dataset.path={str(self.path)!r} {what}: point it at a JSONL file, one prompt "
                                    "per line")
        prompts = []
        for line_no, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                prompts.append(self._row(_json_row(line, self.path, line_no), line_no, len(prompts)))
        if not prompts:
            raise ValueError(f"dataset.path={str(self.path)!r} has no rows")
        return prompts

    def _row(self, row: Any, line_no: int, index: int) -> Prompt:
        where = f"{self.path}:{line_no}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        metadata = row.get(self.metadata_key) if self.metadata_key else None
        if metadata is not None and not isinstance(metadata, dict):
            raise ValueError(f"{where}: {self.metadata_key!r} must be an object (dataset.metadata_key)")
        value = row.get(self.input_key)
        if value is None and not metadata:
            raise ValueError(f"{where}: row has neither {self.input_key!r} (dataset.input_key) nor a non-empty "
                             f"{self.metadata_key!r} (dataset.metadata_key); an agent needs its task from one of them")
        if value is not None and not (isinstance(value, str | list) and value):
            raise ValueError(f"{where}: {self.input_key!r} must be a non-empty string or message list")
        return Prompt(index, value, metadata or {}, self._images(row, value, where))

    def _images(self, row: dict[str, Any], value: Any, where: str) -> tuple[Any, ...]:
        """The row's image sources, checked against its `<image>` placeholders."""
        if self.image_key is None:
            return ()
        sources = row.get(self.image_key)
        if sources is None:
            sources = []
        if not isinstance(sources, list):
            raise ValueError(f"{where}: {self.image_key!r} must be a list of images (dataset.multimodal_keys.image)")
        placeholders = count_placeholders(value)
        if placeholders != len(sources):
            raise ValueError(f"{where}: the prompt has {placeholders} <image> placeholder(s) but {self.image_key!r} "
                             f"holds {len(sources)} image(s); put one <image> where each image goes")
        return tuple(self._source(s, f"{where}: {self.image_key}[{i}]") for i, s in enumerate(sources))

    def _source(self, source: Any, where: str) -> Any:
        """A source with relative paths made absolute; local images are opened once to check them."""
        if isinstance(source, str) and source.startswith(URL_PREFIXES):
            return source
        if isinstance(source, str):
            source = str(resolve_path(source, self.path.parent))
        elif isinstance(source, dict) and isinstance(source.get("path"), str) and not source.get("bytes"):
            source = {**source, "path": str(resolve_path(source["path"], self.path.parent))}
        try:
            open_source(source)
        except MediaError as error:
            raise ValueError(f"{where}: {error}") from None
        return source

    def __len__(self) -> int:
        return len(self.prompts)


def _json_row(line: str, path: Path, line_no: int) -> Any:
    """One line of a JSONL file; a line that is not JSON names the key, the file's line and the fix."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"dataset.path={str(path)!r} line {line_no} is not JSON ({error.msg}): a dataset is a JSONL "
                         "file, one JSON object per line") from None


def _image_key(multimodal_keys: dict[str, str]) -> str | None:
    unknown = sorted(set(multimodal_keys) - set(MEDIA_KINDS))
    if unknown:
        raise ValueError(f"dataset.multimodal_keys has unsupported media kind(s) {unknown}; "
                         f"supported: {list(MEDIA_KINDS)} (for example {{image: images}})")
    return multimodal_keys.get("image")


class DataSource:
    """Seeded epoch order with a return queue for prompts of dropped or filtered groups."""

    def __init__(self, dataset: JsonlDataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0
        self._order: deque[int] = deque()
        self._returned: deque[Prompt] = deque()
        self._held: list[Prompt] = []

    def next(self) -> Prompt:
        if self._returned:
            return self._returned.popleft()
        if not self._order:
            self._new_epoch()
        return self.dataset.prompts[self._order.popleft()]

    def give_back(self, prompt: Prompt) -> None:
        """Return a prompt whose group was dropped or filtered; it is served first from the next step on
        (not within this step, so a prompt that keeps failing cannot take every replacement)."""
        self._held.append(prompt)

    def new_step(self) -> None:
        """Make the prompts given back during the last step available again."""
        self._returned.extend(self._held)
        self._held.clear()

    def _new_epoch(self) -> None:
        order = list(range(len(self.dataset)))
        if self.dataset.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        self._order.extend(order)
        self.epoch += 1

    def state(self) -> dict[str, Any]:
        """The data position, for checkpoints: epoch, the rest of this epoch's order, returned prompts."""
        returned = [p.index for p in (*self._returned, *self._held)]
        return {"epoch": self.epoch, "order": list(self._order), "returned": returned}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state()` was taken."""
        self.epoch = int(state["epoch"])
        self._order = deque(int(i) for i in state["order"])
        self._returned = deque(self.dataset.prompts[int(i)] for i in state["returned"])
