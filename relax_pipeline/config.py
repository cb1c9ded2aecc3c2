"""The config schema: the typed records composed into `Config`, and the checks across nodes.

`conf/config.yaml` composes one run from the groups (docs/design.md §1); each group file merges into the
typed node below, so a misspelt key fails at compose time with Hydra's own message, naming the key and the
record. Every node is one dataclass declared once, next to the code that reads it (`TrainerSettings` in
train/settings.py, `HFEngineSettings` in engine/settings.py, `RolloutSettings` and `EvalSettings` in
stages/settings.py, `GatewaySettings` in gateway/settings.py, `ReplaySettings` and `DebugSettings` in
replay/settings.py, `CheckSettings` in certify/settings.py, `ViewSettings` in view/settings.py, `RaySettings` in
infra/settings.py, ...), with its defaults in one place; a group whose class varies names it in `_target_`, and
groups with several kinds of node (`engine`, `trainer`, `dataset`) register one schema per kind (`<kind>_schema`
in the option's defaults). This module only composes them (`Config`).

`records(cfg)` turns a composed config into those records (each checks its own keys as it is made) and
`validate` checks what spans several nodes, naming the key and the allowed values. Only the job's recipe
(`relax_pipeline/recipes/`) builds objects from the records, and only this module and `run.py` read the composed
config.
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
from relax_pipeline.certify.settings import CheckSettings
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.data.settings import ArithSettings, JsonlSettings
from relax_pipeline.engine.settings import HFEngineSettings, ScriptEngineSettings, SglangEngineSettings
from relax_pipeline.gateway.settings import GatewaySettings
from relax_pipeline.infra.ports import named_port
from relax_pipeline.infra.settings import RaySettings
from relax_pipeline.models.spec import ModelSettings
from relax_pipeline.protocol.suite import ProtocolSuite
from relax_pipeline.replay.settings import DebugSettings, ReplaySettings
from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.stages.settings import EvalSettings, ExportSettings, RolloutSettings
from relax_pipeline.tracking.tracker import TrackingSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerSettings
from relax_pipeline.view.settings import ViewSettings

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
class Config:
    """The whole run: one record per node."""

    job: str = "train"
    """train, rollout, check, eval (evaluate model.path on every eval.datasets entry once; train nothing), view
    (serve the run viewer on `view.dir`) or replay (re-run a replay bundle's credit and loss: `replay.bundle`)."""
    seed: int = 0
    """One seed for data order, sampling and init."""
    protocol: ProtocolSuite = field(default_factory=ProtocolSuite)
    """The model APIs the gateway serves and how output text is parsed (`protocol/suite.py`)."""
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    """Where the gateway listens and the base URL agents are given (`gateway/settings.py`)."""
    runtime: RuntimeSettings = MISSING
    """Typed by `RuntimeSettings`; every `runtime=` preset sets its switches (its class follows from them when the
    record is made)."""
    credit: CreditSettings = field(default_factory=CreditSettings)
    """Rewards and advantages (`credit/settings.py`)."""
    engine: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["engine"]`)."""
    trainer: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["trainer"]`): the torch part, or DeepSpeed's superset."""
    model: ModelSettings = field(default_factory=ModelSettings)
    """The model to load or build (`models/spec.py`)."""
    dataset: Any = None
    """Typed by the chosen option's schema (`SCHEMAS["dataset"]`)."""
    agent: AgentSettings = MISSING
    """Typed by `AgentSettings`; every `agent=` option sets at least `command`."""
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    """Where metrics go and the session traces (`tracking/tracker.py`)."""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """Steps, groups, sampling and history matching of the rollout (`stages/settings.py`)."""
    export: ExportSettings = field(default_factory=ExportSettings)
    """How a forked session exports implicitly (`stages/settings.py`)."""
    eval: EvalSettings = field(default_factory=EvalSettings)
    """Eval datasets, interval, sampling and the eval agent pool (`stages/settings.py`)."""
    debug: DebugSettings = field(default_factory=DebugSettings)
    """The rollout dump and the replay bundles a run writes (`replay/settings.py`)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits for code an agent server runs for a session (`agent/sandbox.py`); sent with every
    agent.executor=http session and applied by the server."""
    ray: RaySettings = field(default_factory=RaySettings)
    """The Ray cluster (agent.executor=ray, engine.placement=ray, trainer.rank_placement=ray)."""
    view: ViewSettings = field(default_factory=ViewSettings)
    """`job=view`: the run folder to show and where the viewer listens (`view/settings.py`)."""
    check: CheckSettings = field(default_factory=CheckSettings)
    """`job=check`: the sessions the certificate examines (`certify/settings.py`)."""
    replay: ReplaySettings = field(default_factory=ReplaySettings)
    """`job=replay`: the bundle to re-run and its checkpoint (`replay/settings.py`)."""
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
    _check_lora_engine(config)
    config.gateway.check_public_url(config.protocol.service_prefix)


def _check_lora_engine(config: Config) -> None:
    """A LoRA run trains an adapter and syncs only the adapter: the engine must serve adapters (engine=hf)."""
    lora = getattr(config.trainer, "lora", None)
    if config.job == "train" and lora is not None and lora.rank is not None and \
            isinstance(config.engine, SglangEngineSettings):
        raise ValueError(f"trainer.lora.rank={lora.rank} with engine=sglang: the SGLang client does not load LoRA "
                         "adapters yet; use engine=hf, or train full weights (trainer.lora.rank=null)")


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
