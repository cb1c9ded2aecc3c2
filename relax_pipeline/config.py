"""The config schema: one typed record per node, composed into `Config`, and the checks across nodes.

`conf/config.yaml` composes one run from the groups (docs/design.md §1); each group file merges into the
typed node below, so a misspelt key fails at compose time with Hydra's own message, naming the key and the
record. Every node is one dataclass declared once, next to the class that takes it (`TrainerSettings` in
train/settings.py, `HFEngineSettings` in engine/settings.py, ...), with its defaults in one place; a group
whose class varies names it in `_target_`, and groups with several kinds of node (`engine`, `trainer`,
`dataset`) register one schema per kind (`<kind>_schema` in the option's defaults). The few nodes no single
class takes whole (`rollout`, `eval`, `export`, `debug`, `view`, `check`, `gateway`, `ray`) are declared here.

`records(cfg)` turns a composed config into those records (each checks its own keys as it is made) and
`validate` checks what spans several nodes, naming the key and the allowed values. Only `run.py` builds
objects from the records, and only this module and `run.py` read the composed config.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from relax_pipeline.agent.launcher import AgentSettings
from relax_pipeline.agent.sandbox import SandboxLimits
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.data.settings import ArithSettings, JsonlSettings
from relax_pipeline.engine.settings import HFEngineSettings, ScriptEngineSettings, SglangEngineSettings
from relax_pipeline.gateway.server import check_bind, check_public_url
from relax_pipeline.infra.ports import named_port
from relax_pipeline.models.spec import ModelSettings
from relax_pipeline.protocol.suite import ProtocolSuite
from relax_pipeline.replay import format as bundle_format
from relax_pipeline.replay.job import ReplayRun, credit_overrides
from relax_pipeline.replay.loss import TrainSetup, torch_keys
from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.tracking.tracker import TrackingSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The config groups ship inside the package, so a wheel can run."""
JOBS = ("train", "rollout", "check", "eval", "view", "replay")
_EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SCHEMAS: dict[str, dict[str, type]] = {
    "engine": {"hf": HFEngineSettings, "scripted": ScriptEngineSettings, "sglang": SglangEngineSettings},
    "trainer": {"torch": TrainerSettings, "deepspeed": DeepSpeedSettings},
    "dataset": {"jsonl": JsonlSettings, "arith": ArithSettings},
}
"""The typed record of each kind of option of a group (its yaml names `<kind>_schema` in its defaults)."""


@dataclass
class GatewayConfig:
    """Where the gateway listens and the base URL agents are given (`gateway/server.py`)."""

    host: str = "127.0.0.1"
    """Address to bind: 127.0.0.1 (this machine only), one of this machine's addresses, or 0.0.0.0 / :: (every
    interface). Anything but loopback needs gateway.allow_remote=true."""
    port: int = 0
    """TCP port; 0 picks a free one (run.log says which)."""
    public_url: str | None = None
    """Base URL agents are given (RELAX_BASE_URL, also what agent.executor=http sends), such as
    http://node0.cluster:8000/agentic_api/: keeps protocol.service_prefix and ends with '/'. None: derived from
    the bound address (a wildcard bind advertises this machine's primary address)."""
    allow_remote: bool = False
    """Allow a bind other hosts can reach; sessions then authenticate only with RELAX_API_KEY. false: loopback
    binds only, where a session's RELAX_SESSION_ID also opens that session."""


@dataclass
class RolloutConfig:
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


@dataclass
class EvalDatasetConfig:
    """One entry of `eval.datasets`; connects the eval config to `stages/evaluate.py`."""

    name: str = MISSING
    """Unique name; metrics are `eval/<name>/...` and dump files `..._eval_<name>_<steps done>...`."""
    path: str = MISSING
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


@dataclass
class EvalConfig:
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
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
    `command`, ...) plus `slots` (that pool's agent slots, checked like runtime.external_slots); empty: eval
    sessions run on the train agents' pool. With a pool of its own, eval slots are counted apart from train's."""


@dataclass
class DebugConfig:
    save_rollout_data: str | None = None
    """Dump path containing {rollout_id}; relative paths resolve in the run's output folder."""
    replay_bundle: bool = False
    """Write a replay bundle per train step under `<output>/replay/step_<n>/` (`relax_pipeline/replay/format.md`):
    rows, credit inputs and outputs, the trainer batch, metrics, config, code version, checkpoint hashes."""
    replay_steps: list[int] | None = None
    """With replay_bundle=true: the steps (0-based) that get a bundle; null: every step."""


@dataclass
class ViewConfig:
    """`job=view`: the run viewer (`relax_pipeline/view/`) over a finished or running run's output folder."""

    dir: str | None = None
    """The run's output folder to show; None shows `output_dir`."""
    host: str = "127.0.0.1"
    """Where the viewer listens; only this machine by default."""
    port: int = 8765
    """The viewer's port; 0 picks a free one (the log line says which)."""
    tokenizer: str | None = None
    """Hugging Face folder whose tokenizer turns token ids into text; None finds the run's (its newest
    checkpoint, else `model.path` or the built tiny model named in its config.yaml)."""


@dataclass
class ReplayConfig:
    """`job=replay`: re-run one recorded step's credit and loss on a CPU (`relax_pipeline/replay/`)."""

    bundle: str | None = None
    """The bundle folder to replay (`<output>/replay/step_<n>`, written with debug.replay_bundle=true)."""
    checkpoint: str | None = None
    """The checkpoint folder from before the step; null: the one the bundle names (its sha256 is checked)."""


@dataclass
class ExportConfig:
    implicit: str = "leaves"
    """Implicit export of a forked session: `leaves` (each root-to-leaf chain is a context, dump field
    `branch`) or `strict` (refuse it, naming the leaves and the forks)."""


@dataclass
class CheckConfig:
    """`job=check`: how many real sessions the certificate examines (`relax_pipeline/certify/`)."""

    sessions: int = 4
    """Sessions of the configured agent run through the configured engine and examined turn by turn (template
    round trip, forks, parsers, export, runtime); 0 checks the config only."""

    def __post_init__(self) -> None:
        if self.sessions < 0:
            raise ValueError(f"check.sessions={self.sessions} must be 0 (the config only) or more")


@dataclass
class RayConfig:
    """The Ray cluster of `agent.executor=ray` and `engine.placement=ray` (`infra/ray_runtime.py`): connected once,
    on first use, and left at the end of the run."""

    address: str | None = None
    """null: start a local Ray instance for this run (stopped at the end); `auto` (a cluster started with `ray
    start` on this machine) or `ray://HOST:10001` / `HOST:6379`: join that cluster."""
    num_cpus: int | None = None
    """address=null: logical CPUs of the local instance (null: the machine's cores)."""
    runtime_env: dict[str, Any] = field(default_factory=dict)
    """Ray runtime_env of the run's workers ({working_dir: ..., pip: [...], env_vars: {...}}): how nodes get the
    package and the agent's code when they do not share this machine's install."""
    node_tmpdir: str | None = None
    """agent.executor=ray: the folder on each node under which a session's files live (input, output, agent.log;
    removed after it); it must exist on every node. null: each node keeps them in memory, under /dev/shm when it is
    memory-backed (tmpfs) with 1 GiB free, else under its temp folder ($TMPDIR, else /tmp); run.log's start line
    says which. Set a disk folder for agents that log gigabytes."""


@dataclass
class Config:
    """The whole run: one record per node."""

    job: str = "train"
    """train, rollout, check, eval (evaluate model.path on every eval.datasets entry once; train nothing), view
    (serve the run viewer on `view.dir`) or replay (re-run a replay bundle's credit and loss: `replay.bundle`)."""
    seed: int = 0
    """One seed for data order, sampling and init."""
    protocol: ProtocolSuite = field(default_factory=ProtocolSuite)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    runtime: RuntimeSettings = MISSING
    """Typed by `RuntimeSettings`; every `runtime=` preset sets its switches (its class follows from them when the
    record is made)."""
    credit: CreditSettings = field(default_factory=CreditSettings)
    engine: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["engine"]`)."""
    trainer: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["trainer"]`): the torch part, or DeepSpeed's superset."""
    model: ModelSettings = field(default_factory=ModelSettings)
    dataset: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["dataset"]`)."""
    agent: AgentSettings = MISSING
    """Typed by `AgentSettings`; every `agent=` option sets at least `command`."""
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits for code an agent server runs for a session (`agent/sandbox.py`); sent with every
    agent.executor=http session and applied by the server."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster (agent.executor=ray, engine.placement=ray, trainer.rank_placement=ray)."""
    view: ViewConfig = field(default_factory=ViewConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    output_dir: str | None = None
    """Where run.log and dumps go; None means Hydra's output folder (or ./outputs/<time> in-process)."""


def examples_root() -> Path:
    """The folder holding `examples/`: the package itself when installed from a wheel (setup.py ships the
    examples inside it), else the repository checkout."""
    package = Path(__file__).resolve().parent
    return package if (package / "examples").is_dir() else REPO_ROOT


def register() -> None:
    """Register the schema (`Config` and each group's per-kind records) and the resolvers `${relax_root:}` (the
    folder holding examples/), `${relax_python:}` and `${relax_free_port:NAME}`."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for group, kinds in SCHEMAS.items():
        for kind, schema in kinds.items():
            store.store(group=group, name=f"{kind}_schema", node=schema)
    if not OmegaConf.has_resolver("relax_root"):
        OmegaConf.register_new_resolver("relax_root", lambda: str(examples_root()))
    if not OmegaConf.has_resolver("relax_python"):
        OmegaConf.register_new_resolver("relax_python", lambda: sys.executable)
    if not OmegaConf.has_resolver("relax_free_port"):
        OmegaConf.register_new_resolver("relax_free_port", named_port)


def records(cfg: DictConfig) -> Config:
    """The composed config as records, every interpolation resolved; each record checks its own keys as it is
    made, so a bad value fails here naming its key. A missing required key is named with its full path."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as error:
        cause = error.__cause__ if isinstance(error.__cause__, ValueError | FileNotFoundError) else None
        if cause is not None:
            raise cause from None
        raise ValueError(f"{error.full_key or 'config'}: {error.msg}") from None


def replay_run(cfg: DictConfig) -> ReplayRun:
    """`job=replay`'s records: the bundle's own config (its format version checked first) with the command line's
    `credit.*` edits laid over its credit node, and its trainer node as `trainer=torch` on the CPU."""
    if not cfg.replay.bundle:
        raise ValueError("job=replay needs replay.bundle=FOLDER (a <output>/replay/step_<n> folder written with "
                         "debug.replay_bundle=true)")
    folder = Path(cfg.replay.bundle).expanduser()
    bundle_format.read_manifest(folder)
    recorded = OmegaConf.create((folder / bundle_format.CONFIG).read_text())
    overrides = credit_overrides(OmegaConf.to_container(cfg.credit, resolve=True))  # type: ignore[arg-type]
    credit = OmegaConf.merge(OmegaConf.structured(CreditSettings), recorded.get("credit") or {}, overrides)
    trainer = OmegaConf.merge(OmegaConf.structured(TrainerSettings),
                              torch_keys(OmegaConf.to_container(recorded.get("trainer") or {})))  # type: ignore[arg-type]
    credit_record: CreditSettings = OmegaConf.to_object(credit)  # type: ignore[assignment]
    train = TrainSetup(OmegaConf.to_object(trainer), int(recorded.get("seed", 0)),  # type: ignore[arg-type]
                       float(recorded.rollout.temperature), credit_record.advantages)
    return ReplayRun(folder, cfg.replay.checkpoint, credit_record, overrides, train)


def check_context_len(max_response_len: int, max_context_len: int | None) -> None:
    """The response limit must leave room for a prompt (checked again once the model's maximum is known)."""
    if max_context_len is not None and max_response_len >= max_context_len:
        raise ValueError(f"rollout.max_response_len={max_response_len} must be smaller than "
                         f"rollout.max_context_len={max_context_len}")


def validate(config: Config) -> None:
    """Checks across nodes that no single record can make; each error names the key and the allowed values."""
    if config.job not in JOBS:
        raise ValueError(f"job={config.job!r} is not a job; choose one of {list(JOBS)}")
    _check_rollout(config)
    _check_multi_context(config)
    _check_eval(config)
    if config.agent.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("agent.executor=ray needs Ray: pip install 'relax_pipeline[ray]' (ray[default]==2.60.0); "
                         "or use agent.executor=local")
    _check_sglang_sessions(config)
    check_bind(config.gateway.host, config.gateway.port, config.gateway.allow_remote)
    if config.gateway.public_url is not None:
        check_public_url(config.gateway.public_url, config.protocol.service_prefix)


def _check_sglang_sessions(config: Config) -> None:
    """An SGLang session must outlive its agent session's active time, or SGLang drops its KV mid-session."""
    engine, timeout = config.engine, config.agent.timeout
    if not isinstance(engine, SglangEngineSettings) or not engine.sessions or timeout is None:
        return
    if engine.session_timeout_s is not None and engine.session_timeout_s < timeout:
        raise ValueError(f"engine.session_timeout_s={engine.session_timeout_s} is shorter than "
                         f"agent.timeout={timeout}: SGLang would close a session while its agent still runs; raise "
                         "engine.session_timeout_s (or null: no timeout)")


def _check_rollout(config: Config) -> None:
    r = config.rollout
    for key in ("num_steps", "batch_size", "n_samples_per_prompt", "max_response_len", "max_context_len"):
        if key == "num_steps" and config.job == "eval":
            continue  # job=eval runs no steps
        value = getattr(r, key)
        if value is not None and value <= 0:
            raise ValueError(f"rollout.{key} must be positive, got {value}")
    check_context_len(r.max_response_len, r.max_context_len)
    if r.history not in ("tokens", "render"):
        raise ValueError(f"rollout.history={r.history!r}; choose tokens or render")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.batch_size:
        raise ValueError(f"rollout.over_sampling_batch_size={r.over_sampling_batch_size} must be at least "
                         f"rollout.batch_size ({r.batch_size}) or null")


def multi_context_missing(config: Config, several_contexts: bool) -> list[str]:
    """The settings a run lacks for sessions that export several contexts (empty when it has them all);
    `several_contexts`: whether the configured credit class credits such sessions."""
    missing = [] if several_contexts else ["credit=custom_advantage"]
    if not config.trainer.batching.use_dynamic_batch_size:
        missing.append("trainer.batching.use_dynamic_batch_size=true")
    return missing


def _check_multi_context(config: Config) -> None:
    if not config.agent.multi_context:
        return
    missing = multi_context_missing(config, get_class(config.credit._target_).credits_several(config.credit))
    if missing:
        raise ValueError(f"agent.multi_context=true (sessions export several contexts) needs {' and '.join(missing)}; "
                         "set them, or agent.multi_context=false if each session exports one context")


def _check_eval(config: Config) -> None:
    ev = config.eval
    for key, value in (("eval.interval", ev.interval), ("eval.n_samples_per_prompt", ev.n_samples_per_prompt)):
        if value is not None and value <= 0:
            raise ValueError(f"{key} must be positive or null, got {value}")
    if config.job == "eval" and not ev.datasets:
        raise ValueError("job=eval evaluates the eval.datasets entries and there are none: set "
                         "eval.datasets=[{name:NAME,path:FILE.jsonl}]")
    if ev.interval is not None and not ev.datasets:
        raise ValueError(f"eval.interval={ev.interval} needs at least one eval dataset: set "
                         "eval.datasets=[{name:NAME,path:FILE.jsonl}], or eval.interval=null")
    names: set[str] = set()
    for i, entry in enumerate(ev.datasets):
        if not _EVAL_NAME.fullmatch(entry.name) or entry.name in names:
            raise ValueError(f"eval.datasets[{i}].name={entry.name!r} must be unique and use only letters, digits, "
                             "'_', '-' or '.' (it names the metrics eval/<name>/...)")
        names.add(entry.name)
        if entry.n_samples_per_prompt is not None and entry.n_samples_per_prompt <= 0:
            raise ValueError(f"eval.datasets[{i}].n_samples_per_prompt must be positive or null, "
                             f"got {entry.n_samples_per_prompt}")


def quote_placeholders(overrides: list[str]) -> list[str]:
    """Quote override values holding `{rollout_id}`: Hydra's grammar reads a bare `{` as a dict."""
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and "{rollout_id}" in value and value[:1] not in ("'", '"'):
            arg = f"{key}='{value}'" if "'" not in value else f'{key}="{value}"'
        out.append(arg)
    return out
