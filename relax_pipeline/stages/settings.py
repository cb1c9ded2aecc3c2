"""The nodes the stages read, as records: `rollout` (`RolloutSettings`), `eval` (`EvalSettings` and one
`EvalDatasetSettings` per `eval.datasets` entry) and `export` (`ExportSettings`).

Each record checks its own keys as it is made; what spans several nodes (a positive `rollout.num_steps` except
for `job=eval`, eval datasets that `eval.interval` needs) is `config.validate`'s. The records also give the
sampling every turn of a mode gets (`RolloutSettings.sampling`, `EvalSettings.sampling`), the one place those
keys become `SamplingDefaults`. Nothing here builds a stage (`recipes/parts.py` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.forest.export import IMPLICIT_MODES
from relax_pipeline.turn.records import SamplingDefaults
from relax_pipeline.turn.service import check_history


@dataclass
class RolloutSettings:
    """The `rollout` node; connects the config to Prepare (group size, template kwargs), the pipeline (groups per
    step), the runtime strategy (groups in flight, steps) and the turn service (sampling, history)."""

    num_steps: int = 2
    """Rollout steps (--num-rollout)."""
    batch_size: int = 4
    """Prompt groups per step."""
    n_samples_per_prompt: int = 2
    """Sessions per group."""
    over_sampling_batch_size: int | None = None
    """Groups in flight per step; None means batch_size."""
    max_response_len: int = 64
    """Most tokens generated per turn."""
    max_context_len: int | None = None
    """Most tokens in a prompt plus its response; None: the model's own maximum (`max_position_embeddings`).
    Real harnesses send long prompts (Codex about 13.6k tokens, Claude Code 7.6k-50k)."""
    history: str = "tokens"
    """How a re-sent history is matched: `tokens` (an assistant turn re-sent without fields the harness
    dropped, such as reasoning_content, reuses its committed tokens) or `render` (re-rendered as sent)."""
    temperature: float = 1.0
    """Sampling temperature (requests cannot change it)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Default template kwargs written into each session's input."""

    def __post_init__(self) -> None:
        check_history(self.history)

    def sampling(self, context_len: int) -> SamplingDefaults:
        """What every train turn samples with, `context_len` being the run's resolved context limit."""
        return SamplingDefaults(self.max_response_len, context_len, self.temperature, self.top_p, self.top_k)


@dataclass
class EvalDatasetSettings:
    """One entry of `eval.datasets`; connects the eval config to `stages/evaluate.py`."""

    name: str
    """Unique name; metrics are `eval/<name>/...` and dump files `..._eval_<name>_<steps done>...`."""
    path: str
    """JSONL file, one prompt per line; every prompt is evaluated once per eval run, in file order."""
    input_key: str = "input"
    """Row key holding the prompt: a string (one user message) or a message list."""
    metadata_key: str | None = "metadata"
    """Row key passed to the agent as input metadata."""
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """Media kind → row key, as `dataset.multimodal_keys`."""
    n_samples_per_prompt: int | None = None
    """Sessions per prompt of this dataset; None means eval.n_samples_per_prompt."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Merged into every prompt's metadata, which the agent reads: e.g. `{tools: false}` evaluates the same
    problems with the agent's tool withheld (a single-shot control)."""

    def source(self) -> dict[str, Any]:
        """The `dataset` keys this entry replaces in the train dataset's record (`data/settings.py`'s
        `with_source`)."""
        return {"path": self.path, "input_key": self.input_key, "metadata_key": self.metadata_key,
                "multimodal_keys": dict(self.multimodal_keys)}


@dataclass
class EvalSettings:
    """The `eval` node; connects the config to the evaluator (datasets, interval), the eval sampling and the eval
    sessions' own agent pool."""

    datasets: list[EvalDatasetSettings] = field(default_factory=list)
    """Eval datasets, built like `dataset` (`eval.datasets=[{name:math,path:/data/math.jsonl}]`)."""
    n_samples_per_prompt: int = 1
    """Sessions per eval prompt when a dataset sets none."""
    interval: int | None = None
    """Run eval before the first step and every N steps (job=train and job=rollout); None disables eval."""
    temperature: float = 0.0
    """Eval sampling temperature, independent of rollout.temperature; 0 is greedy (pass@1)."""
    max_response_len: int | None = None
    """Most tokens generated per eval turn; None: rollout.max_response_len."""
    agent: dict[str, Any] = field(default_factory=dict)
    """Eval sessions' own agent pool: `agent.*` keys that differ for eval (`executor`, `server_url`, `resources`,
    `command`, `services`, ...) plus `slots` (that pool's agent slots, checked like runtime.external_slots); empty:
    eval sessions run on the train agents' pool. With a pool of its own, eval slots are counted apart from train's,
    and services of its own start with the train pool's."""

    def sampling(self, rollout: RolloutSettings, context_len: int) -> SamplingDefaults:
        """What every eval turn samples with: `eval.temperature`, `eval.max_response_len` (else rollout's)."""
        return SamplingDefaults(self.max_response_len or rollout.max_response_len, context_len, self.temperature)


@dataclass
class ExportSettings:
    """The `export` node; connects the config to the Runtime stage's export matching."""

    implicit: str = "leaves"
    """Implicit export of a forked session: `leaves` (each root-to-leaf chain is a context, dump field
    `branch`) or `strict` (refuse it, naming the leaves and the forks)."""

    def __post_init__(self) -> None:
        if self.implicit not in IMPLICIT_MODES:
            raise ValueError(f"export.implicit={self.implicit!r}; choose one of {list(IMPLICIT_MODES)}")
