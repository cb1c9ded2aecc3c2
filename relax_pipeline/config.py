"""Structured config: the typed schema of every key, registered in Hydra's ConfigStore.

`conf/config.yaml` composes one run from the groups in DESIGN §1; each group file merges into the
typed node below, so a misspelt key fails at compose time with Hydra's own message. Each group node
carries a `_target_` naming our class, and `build` is the one instantiate helper (extra constructor
arguments such as the model path are passed at build time). Cross-key rules that a schema cannot
express are checked by `validate`, which names the key and the allowed values.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import MISSING, DictConfig, OmegaConf

from relax_pipeline.gateway.server import check_bind, check_public_url
from relax_pipeline.infra.ports import named_port
from relax_pipeline.train.advantages import AdvantageSettings
from relax_pipeline.train.base import Trainer
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.optim import OptimSettings

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = Path(__file__).resolve().parent / "conf"
"""The config groups ship inside the package, so a wheel can run."""
JOBS = ("train", "rollout", "check", "eval", "view")
_EVAL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass
class ProtocolConfig:
    _target_: str = "relax_pipeline.protocol.suite.ProtocolSuite"
    apis: list[str] = field(default_factory=lambda: ["chat", "responses", "messages"])
    """Front-ends the gateway serves: chat (OpenAI Chat Completions), responses (OpenAI Responses), messages
    (Anthropic Messages)."""
    reasoning_parser: str | None = "qwen3"
    """SGLang reasoning-parser name used to split `<think>` text."""
    tool_call_parser: str | None = "qwen25"
    """SGLang tool-call-parser name used to extract tool calls."""
    service_prefix: str = "/agentic_api"
    """URL path the gateway serves under; RELAX_BASE_URL keeps it."""
    sse_heartbeat_s: float = 15.0
    """Seconds between Buffered SSE heartbeats."""


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


CAPACITY_KEYS = ("concurrency", "eval_concurrency", "external_slots")
"""`runtime.*` keys that size the run (`stages.capacity.Capacity`), not the strategy."""


@dataclass
class RuntimeConfig:
    _target_: str = "relax_pipeline.scheduling.sync.SyncRuntime"
    concurrency: int | None = None
    """Resident prompt groups (Prepare + Runtime); None means rollout.over_sampling_batch_size."""
    eval_concurrency: int | None = None
    """Eval groups in flight per dataset; None: ceil(resident sessions / the dataset's group size)."""
    max_aborted_count: int = 2
    """Partial rollout: aborts after which a request is protected."""
    barrier_warn_s: float = 60.0
    """Log the missing sessions when a group's first-request barrier waits longer than this."""
    max_staleness: int | None = None
    """fully_async: drop groups whose first token is more than this many weight versions old; None: no bound."""
    external_slots: int | None = None
    """Agent slots of an external platform; the start-up capacity check refuses too few. None: local agents."""


@dataclass
class CreditConfig:
    _target_: str = "relax_pipeline.credit.reward.RewardCredit"
    reward_key: str | None = None
    """Key of the primary value when an exported reward is an object."""
    rm_path: str | None = None
    """module.function custom reward model (credit=custom_rm)."""
    advantage_path: str | None = None
    """module.function per-context advantage hook (credit=custom_advantage)."""
    estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline."""
    normalize_std: bool = True
    """GRPO: divide the group-centred reward by the group's std."""
    kl_coef: float = 0.0
    """KL reward shaping coefficient (reinforce_plus_plus estimators)."""
    normalize_advantages: bool = False
    """Whiten token advantages across the batch."""
    log_passrate: bool = False
    """Log `passrate` (primary reward == 1)."""
    filter_path: str | None = None
    """module.function(samples) -> bool: keep a scored train group; False filters it and its prompt returns."""
    truncated_reward: float = 0.0
    """Reward of a session recorded as truncated by our length limit when the agent then failed (no reward
    exported); a reward model, when configured, scores it first."""


@dataclass
class EngineConfig:
    """`engine=hf`: the embedded transformers engine (each engine option has its own schema)."""

    _target_: str = "relax_pipeline.engine.hf.HFEngine"
    device: str = "cpu"
    """torch device for the embedded engine."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16 or float16."""
    max_batch_size: int = 32
    """Most sequences decoded together."""
    threads: int | None = None
    """torch intra-op threads (`torch.set_num_threads`, process-wide); None keeps torch's default."""
    kv_cache_mb: int = 1024
    """Prefix KV cache budget in MiB: sessions' earlier turns and shared prompts are not prefilled again
    (least recently used entries go first); 0 turns it off."""
    attn_implementation: str | None = None
    """Attention kernel: `eager`, `sdpa`, or `grouped` (eager without copying the KV cache for each query head,
    models/attention.py); null keeps transformers' default (sdpa). bfloat16 on a CPU decodes faster with eager,
    and faster still with grouped."""


@dataclass
class ScriptedEngineConfig:
    """`engine=scripted`: a fake engine replaying a JSONL script of assistant turns (testing/script_engine.py)."""

    _target_: str = "relax_pipeline.testing.script_engine.ScriptEngine"
    script: str = MISSING
    """JSONL, one assistant turn a line: {"content", "reasoning", "tool_calls": [{"name", "arguments"}],
    "finish": "stop"|"length"}, all optional; every session replays it from line 1, then answers "done."."""


@dataclass
class SglangEngineConfig:
    """`engine=sglang`: SGLang servers over their native HTTP API (engine/sglang.py); connect or launch."""

    _target_: str = "relax_pipeline.engine.sglang.SglangEngine"
    urls: list[str] = field(default_factory=list)
    """Running SGLang servers to connect to (`[http://HOST:PORT, ...]`); empty with launch=true."""
    launch: bool = False
    """Start `servers` SGLang servers (launch_command + server_args), logs in <output>/sglang/, stopped at the end."""
    servers: int = 1
    """Servers to launch, one per GPU group."""
    gpus_per_server: int = 1
    """GPUs of each launched server (consecutive CUDA_VISIBLE_DEVICES); 0 leaves CUDA_VISIBLE_DEVICES alone."""
    launch_command: str = "python -m sglang.launch_server"
    """Command of one server; `--model-path --host --port` and server_args are appended."""
    server_args: dict[str, Any] = field(default_factory=dict)
    """Extra server flags: {mem_fraction_static: 0.8, tp_size: 2} → --mem-fraction-static 0.8 --tp-size 2."""
    launch_timeout: float = 900.0
    """Seconds a launched server (or the router) may take to answer /health."""
    host: str = "127.0.0.1"
    """Host launched servers and the router bind to."""
    router: str = "none"
    """none (the client routes by cache affinity itself) or sglang (the real sglang-router in front)."""
    router_url: str | None = None
    """A running sglang-router (started with --policy manual); None starts one with router_command."""
    router_command: str = "python -m sglang_router.launch_router"
    """Command of the router; host, port, --worker-urls, --policy manual and router_args are appended."""
    router_args: dict[str, Any] = field(default_factory=dict)
    """Extra router flags, as server_args."""
    admission: str = "none"
    """none, or kv: reserve prompt + max_new_tokens against the worker's KV capacity before generating."""
    kv_headroom: float = 0.9
    """admission=kv: fraction of the reported KV capacity (max_total_num_tokens) that may be reserved."""
    admission_max_wait_s: float = 300.0
    """admission=kv: longest wait for room; then the request starts anyway (counted in engine/admission_timeouts)."""
    weights_dir: str | None = None
    """Where weights are written for /update_weights_from_disk (must be readable by the servers); None:
    <output>/sglang/weights."""
    log_dir: str | None = None
    """Logs of launched servers and router; None: <output>/sglang."""
    max_batch_size: int = 32
    """Sessions job=eval keeps in flight by default (as engine=hf's batch)."""
    affinity_block: int = 16
    """Tokens per block of the prefix hashes that keep a session and a prompt's siblings on one worker."""
    placement: str | None = None
    """launch=true: local (servers are subprocesses of this machine) or ray (one placement-group bundle per server
    on the Ray cluster at ray.address, engine/sglang_ray.py); null: ray when ray.address is set, else local."""
    placement_strategy: str = "PACK"
    """placement=ray: how bundles spread over nodes (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    cpus_per_server: float = 1.0
    """placement=ray: CPUs each server's bundle holds (besides gpus_per_server GPUs)."""


ENGINE_SCHEMAS = {"hf": EngineConfig, "scripted": ScriptedEngineConfig, "sglang": SglangEngineConfig}


def engine_context(engine: DictConfig, output_dir: Path, ray: DictConfig | None = None) -> dict[str, Any]:
    """Run-level arguments an engine class takes besides its keys: `output_dir` (engine=sglang's logs and weights),
    `ray` (the run's `ray.*` keys, for servers placed on a Ray cluster)."""
    taken = inspect.signature(get_class(engine._target_)).parameters
    context: dict[str, Any] = {"output_dir": str(output_dir)} if "output_dir" in taken else {}
    if "ray" in taken and ray is not None:
        context["ray"] = OmegaConf.to_container(ray, resolve=True)
    return context
"""The typed schema of each `engine=` option (its yaml names `<option>_schema` in its defaults)."""


@dataclass
class TrainerConfig:
    _target_: str = "relax_pipeline.train.torch_backend.TorchTrainer"
    device: str = "cpu"
    """torch device of the policy being trained."""
    loss: LossSettings = field(default_factory=LossSettings)
    """The policy loss (train/losses.py): PPO clipping, off-policy corrections, entropy bonus, reference KL."""
    batching: BatchSettings = field(default_factory=BatchSettings)
    """Optimizer steps and micro-batches (train/batching.py)."""
    optim: OptimSettings = field(default_factory=OptimSettings)
    """AdamW and gradient clipping (train/optim.py)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (trainer=deepspeed only)."""
    num_ranks: int = 1
    """Data-parallel training processes on this machine (trainer=deepspeed only): the run is rank 0 and
    starts ranks 1..N-1, logging to <output>/trainer_ranks/rank<r>.log (train/rank_group.py)."""
    rank_placement: str = "local"
    """Where ranks 1..N-1 run (trainer=deepspeed, num_ranks > 1): `local` (processes of this machine) or `ray`
    (Ray actors on the cluster at ray.address, any node with room for rank_resources; train/rank_ray.py)."""
    rank_resources: dict[str, float] = field(default_factory=dict)
    """rank_placement=ray: what each rank holds ({num_gpus: 1} on GPU nodes, custom resources to pin nodes);
    empty: {num_cpus: 1}."""
    save_interval: int | None = None
    """Save a checkpoint every N steps (and at the end); None saves only at the end."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint_dir."""
    checkpoint_dir: str | None = None
    """Where checkpoints are written and resumed from; None means <output folder>/checkpoints."""
    keep_checkpoints: int | None = None
    """Keep only the last N checkpoint folders (older ones are deleted after each save); None keeps all."""
    save_optimizer: bool = True
    """Save the optimizer state with each checkpoint; false saves weights only (a resume then restarts the
    optimizer and says so)."""
    autocast: str | None = None
    """Mixed precision for the forward and backward: `bfloat16` (or `float16`) under torch.autocast, weights
    and optimizer state in float32; null trains in float32 (logprobs then match a float32 engine's)."""
    attn_implementation: str | None = None
    """The policy's attention kernel: `eager`, `sdpa`, or `grouped` (models/attention.py: eager without copying
    the KV cache for each query head; on a CPU under bf16 autocast about 25% faster a step than sdpa); null keeps
    transformers' default (sdpa)."""
    keep_freed_memory: bool | None = None
    """Keep freed CPU memory mapped for reuse (glibc mallopt, train/allocator.py): large training tensors then
    skip the page faults of fresh memory, and the process keeps its peak size. Null: on for a CPU device."""
    # Deprecated flat aliases, kept for one release (FLAT_TRAINER_KEYS): a value set here moves into its
    # nested node at start, where it wins over the nested value, and the run logs a deprecation line.
    lr: float | None = None
    """Deprecated alias of trainer.optim.lr."""
    weight_decay: float | None = None
    """Deprecated alias of trainer.optim.weight_decay."""
    grad_clip: float | None = None
    """Deprecated alias of trainer.optim.grad_clip."""
    global_batch_size: int | None = None
    """Deprecated alias of trainer.batching.global_batch_size."""
    micro_batch_size: int | None = None
    """Deprecated alias of trainer.batching.micro_batch_size."""
    use_dynamic_batch_size: bool | None = None
    """Deprecated alias of trainer.batching.use_dynamic_batch_size."""
    max_tokens_per_gpu: int | None = None
    """Deprecated alias of trainer.batching.max_tokens_per_gpu."""
    eps_clip_low: float | None = None
    """Deprecated alias of trainer.loss.eps_clip_low."""
    eps_clip_high: float | None = None
    """Deprecated alias of trainer.loss.eps_clip_high."""
    use_rollout_logprobs: bool | None = None
    """Deprecated alias of trainer.loss.use_rollout_logprobs."""
    tis_cap: float | None = None
    """Deprecated alias of trainer.loss.tis_cap."""
    opsm_delta: float | None = None
    """Deprecated alias of trainer.loss.opsm_delta."""
    entropy_coef: float | None = None
    """Deprecated alias of trainer.loss.entropy_coef."""
    use_kl_loss: bool | None = None
    """Deprecated alias of trainer.loss.use_kl_loss."""
    kl_loss_coef: float | None = None
    """Deprecated alias of trainer.loss.kl_loss_coef."""
    kl_loss_type: str | None = None
    """Deprecated alias of trainer.loss.kl_loss_type."""
    loss_reduction: str | None = None
    """Deprecated alias of trainer.loss.loss_reduction."""


TRAINER_NODES: dict[str, type] = {"loss": LossSettings, "batching": BatchSettings, "optim": OptimSettings}
"""The nested trainer nodes and the record each one is (what the trainer class takes)."""
FLAT_TRAINER_KEYS: dict[str, str] = {f.name: f"{node}.{f.name}" for node, record in TRAINER_NODES.items()
                                     for f in fields(record)}
"""Deprecated flat key → its nested key (`lr` → `optim.lr`), both under `trainer.`; removed next release."""
LOOP_TRAINER_KEYS: tuple[str, ...] = ("save_interval", "resume", "checkpoint_dir", "keep_checkpoints")
"""Trainer keys the step loop's checkpoint schedule reads (run.py); the trainer class does not take them."""


@dataclass
class ModelConfig:
    _target_: str = "relax_pipeline.models.spec.ModelSpec"
    name: str = "tiny"
    """Label echoed as the model id."""
    path: str | None = None
    """Local Hugging Face folder; None builds `name` (`tiny` or `tiny_vl`) locally."""
    cache_dir: str | None = None
    """Where the tiny model is built; None means $RELAX_CACHE_DIR or ~/.cache/relax_pipeline."""
    end_of_turn: str | None = None
    """Template end-of-turn token; None detects it from the chat template."""


@dataclass
class DatasetConfig:
    """`dataset=digits|toy`: prompts from a JSONL file (each dataset option has its own schema)."""

    _target_: str = "relax_pipeline.data.dataset.JsonlDataset"
    path: str = MISSING
    """JSONL file, one prompt per line."""
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
class ArithDatasetConfig:
    """`dataset=arith`: generated arithmetic problems with a fixed held-out split (data/arith.py)."""

    _target_: str = "relax_pipeline.data.arith.ArithDataset"
    split: str = "train"
    """Which split the run trains on: `train` or `heldout` (eval entries choose theirs with `path: arith:<split>`)."""
    operations: list[str] = field(default_factory=lambda: ["+"])
    """Operations drawn from: `+`, `-`, `*`."""
    low: int = 0
    """Smallest operand."""
    high: int = 99
    """Largest operand (0-99: one- and two-digit numbers)."""
    heldout_size: int = 200
    """Problems in the held-out split; it depends only on seed, operations, low, high and this size."""
    train_size: int | None = None
    """Problems in the train split, none of them held out; None: every other problem of the space."""
    seed: int = 0
    """Seed of the problem set, independent of the run's `seed` (every run sees the same held-out problems)."""
    prompt: str = "What is {a} {op} {b}? Answer with just the number."
    """Prompt text; `{a}`, `{op}` and `{b}` are filled in. The answer goes to the row's `metadata.answer`."""
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


DATASET_SCHEMAS = {"jsonl": DatasetConfig, "arith": ArithDatasetConfig}
"""The typed schema of each kind of `dataset=` option (its yaml names `<kind>_schema` in its defaults)."""


@dataclass
class ServiceConfig:
    """One helper process of `agent.services`, keyed by its name (a retrieval index, an agent server)."""

    command: str = MISSING
    """Shell command run by `bash -c` once per run, before the first rollout; stopped at the end."""
    cwd: str | None = None
    """Working directory; None keeps the run's."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (the RELAX_ prefix is reserved)."""
    port: int | None = None
    """The port it listens on, for interpolation (`${relax_free_port:NAME}` picks a free one once per run)."""
    health_url: str | None = None
    """Polled until it answers 2xx before any agent starts; None: started is ready."""
    startup_timeout: float = 120.0
    """Seconds the health URL may take to answer before the run fails, naming the service and its log."""


@dataclass
class SandboxConfig:
    """Limits for code an agent server runs for a session (`relax_pipeline.agent.sandbox`); sent with every
    `agent.executor=http` session and applied by the server."""

    allow_network: bool = False
    """False: code runs in its own network namespace (loopback only); where the platform has none, sessions are
    refused. True: code keeps the host's network."""
    cpu_s: int = 60
    """CPU seconds per command (RLIMIT_CPU)."""
    memory_mb: int = 2048
    """Address space per process in MiB (RLIMIT_AS)."""
    file_mb: int = 64
    """Largest file a command may write, in MiB (RLIMIT_FSIZE)."""
    max_processes: int = 128
    """Processes and threads of the sandbox user (RLIMIT_NPROC); stops fork bombs."""
    timeout: float = 60.0
    """Wall seconds per command; then its whole process tree is killed."""


AGENT_EXECUTORS = ("local", "http", "ray")
"""Where agents run (`agent.executor`): a local process group per session, a session sent to an agent server, or a
session run on a node of a Ray cluster (`agent/ray_executor.py`)."""


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
    removed after it); null: the node's temp folder ($TMPDIR, else /tmp). A RAM-backed one (/dev/shm) makes each
    start cheaper where the disk is slow; it must exist on every node."""


@dataclass
class AgentConfig:
    _target_: str = "relax_pipeline.agent.launcher.AgentSpec"
    command: str = MISSING
    """Shell command run by `bash -c` once per session."""
    cwd: str | None = None
    """Working directory of the agent process."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (the RELAX_ prefix is reserved)."""
    timeout: float | None = 120.0
    """Active-time budget in seconds; None means no limit."""
    multi_context: bool = False
    """Sessions export several training contexts; needs credit=custom_advantage and dynamic batching
    (trainer.batching.use_dynamic_batch_size)."""
    executor: str = "local"
    """local (one process group per session on this machine), http (each session is POSTed to
    agent.server_url, an agent server that runs it; docs/agentic-rollout.md has the contract) or ray (each session
    runs on a node of the Ray cluster at ray.address; files travel with the call, no shared disk)."""
    resources: dict[str, float] = field(default_factory=dict)
    """executor=ray: what one session holds on its node ({num_cpus: 1}, {num_gpus: 1}, {sandbox: 1} for a custom
    resource); a node runs as many sessions at once as its Ray resources allow; {}: no limit."""
    server_url: str | None = None
    """executor=http: base URL of the agent server (its POST /sessions runs one session)."""
    nice: int | None = None
    """executor=local and ray: lower each agent's CPU priority by this much (0-19), so the run's engine, gateway and
    trainer win the cores when many agents start at once (Linux: the agent's session, all its processes); null:
    unchanged."""
    services: dict[str, ServiceConfig] = field(default_factory=dict)
    """Processes started once per run before the first rollout, health-checked, stopped at the end; logs in
    `<output>/services/<name>.log`."""


@dataclass
class TrackingConfig:
    _target_: str = "relax_pipeline.tracking.tracker.NullTracker"
    project: str = "relax_pipeline"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account default."""
    name: str | None = None
    """Run name; None lets W&B choose."""
    mode: str | None = None
    """online, offline or disabled; None means offline unless WANDB_API_KEY is set."""


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


@dataclass
class DebugConfig:
    save_rollout_data: str | None = None
    """Dump path containing {rollout_id}; relative paths resolve in the run's output folder."""


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
class ExportConfig:
    implicit: str = "leaves"
    """Implicit export of a forked session: `leaves` (each root-to-leaf chain is a context, dump field
    `branch`) or `strict` (refuse it, naming the leaves and the forks)."""


@dataclass
class Config:
    job: str = "train"
    """train, rollout, check, eval (evaluate model.path on every eval.datasets entry once; train nothing) or view
    (serve the run viewer on `view.dir`)."""
    seed: int = 0
    """One seed for data order, sampling and init."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    engine: Any = None
    """Typed by the chosen option's schema (`ENGINE_SCHEMAS`)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: Any = None
    """Typed by the chosen option's schema (`DATASET_SCHEMAS`)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray cluster (agent.executor=ray, engine.placement=ray)."""
    view: ViewConfig = field(default_factory=ViewConfig)
    output_dir: str | None = None
    """Where run.log and dumps go; None means Hydra's output folder (or ./outputs/<time> in-process)."""


def examples_root() -> Path:
    """The folder holding `examples/`: the package itself when installed from a wheel (setup.py ships the
    examples inside it), else the repository checkout."""
    package = Path(__file__).resolve().parent
    return package if (package / "examples").is_dir() else REPO_ROOT


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for option, schema in ENGINE_SCHEMAS.items():
        store.store(group="engine", name=f"{option}_schema", node=schema)
    for kind, schema in DATASET_SCHEMAS.items():
        store.store(group="dataset", name=f"{kind}_schema", node=schema)
    """Register the schema and the resolvers `${relax_root:}` (repo folder) and `${relax_python:}`."""
    if not OmegaConf.has_resolver("relax_root"):
        OmegaConf.register_new_resolver("relax_root", lambda: str(examples_root()))
    if not OmegaConf.has_resolver("relax_python"):
        OmegaConf.register_new_resolver("relax_python", lambda: sys.executable)
    if not OmegaConf.has_resolver("relax_free_port"):
        OmegaConf.register_new_resolver("relax_free_port", named_port)


def build(node: DictConfig | Any, **kwargs: Any) -> Any:
    """Instantiate one group node; plain Python containers, never OmegaConf ones, reach our classes
    (`_convert_="object"`: nested nodes typed by a dataclass arrive as that dataclass).

    A constructor's own error (which names the key and the fix) is raised as it is, not wrapped.
    """
    kwargs.setdefault("_convert_", "all")
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        if error.__cause__ is not None:
            raise error.__cause__ from None
        raise


def build_runtime(cfg: DictConfig) -> Any:
    """The `runtime` group's strategy, from `runtime_node`."""
    return build(runtime_node(cfg.runtime))


def runtime_node(runtime: DictConfig) -> DictConfig:
    """The runtime node as its strategy takes it: the capacity keys (`CAPACITY_KEYS`, read once into
    `Capacity` by run.py) left out. A key this mode does not take must stay null: setting it is an error
    naming the key (`runtime.max_staleness` means something only under `runtime=fully_async`)."""
    taken = inspect.signature(get_class(runtime._target_)).parameters
    unused = [k for k in runtime if k != "_target_" and k not in CAPACITY_KEYS and k not in taken]
    for key in unused:
        if runtime[key] is not None:
            raise ValueError(f"runtime.{key}={runtime[key]!r} is not used by {runtime._target_.rpartition('.')[2]}; "
                             "unset it or choose the runtime mode that uses it")
    return OmegaConf.masked_copy(runtime, [k for k in runtime if k not in CAPACITY_KEYS and k not in unused])


def build_trainer(cfg: DictConfig, model_path: str, output_dir: Path | None = None) -> Trainer:
    """The `trainer` group's object: `trainer_node` with its nested nodes as records, plus `trainer_context`
    (and `output_dir` when the class takes it: trainer=deepspeed's rank logs)."""
    node = trainer_node(cfg.trainer)
    run = engine_context(node, output_dir, cfg.ray) if output_dir is not None else {}
    return build(node, _convert_="object", model_path=model_path, **trainer_context(cfg), **run)


def trainer_node(trainer: DictConfig) -> DictConfig:
    """The trainer node as its class takes it: flat aliases moved into their nodes and dropped, and the
    checkpoint keys the loop reads (LOOP_TRAINER_KEYS) left out."""
    move_flat_trainer_keys(trainer)
    skip = {*FLAT_TRAINER_KEYS, *LOOP_TRAINER_KEYS}
    return OmegaConf.masked_copy(trainer, [key for key in trainer if key not in skip])


def trainer_context(cfg: DictConfig) -> dict[str, Any]:
    """What the trainer must agree on with the other groups: seed, the rollout's temperature, the credit keys."""
    credit = cfg.credit
    return {"seed": cfg.seed, "temperature": cfg.rollout.temperature,
            "advantages": AdvantageSettings(credit.estimator, credit.kl_coef, credit.normalize_advantages)}


def move_flat_trainer_keys(trainer: DictConfig) -> None:
    """Move each deprecated flat key that is set (`trainer.lr`) into its nested node (`trainer.optim.lr`),
    where it wins, and null the flat key; logs one deprecation line per key. Calling it again does nothing."""
    for flat, nested in FLAT_TRAINER_KEYS.items():
        value = trainer.get(flat)
        if value is None:
            continue
        log.warning("trainer.%s is deprecated and goes away in the next release; use trainer.%s", flat, nested)
        OmegaConf.update(trainer, nested, value)
        trainer[flat] = None


def check_context_len(max_response_len: int, max_context_len: int | None) -> None:
    """The response limit must leave room for a prompt (checked again once the model's maximum is known)."""
    if max_context_len is not None and max_response_len >= max_context_len:
        raise ValueError(f"rollout.max_response_len={max_response_len} must be smaller than "
                         f"rollout.max_context_len={max_context_len}")


def validate(cfg: DictConfig) -> None:
    """Cross-key checks a schema cannot express; each error names the key and the allowed values.

    First moves the deprecated flat trainer keys into their nested nodes (`move_flat_trainer_keys`).
    """
    move_flat_trainer_keys(cfg.trainer)
    if cfg.job not in JOBS:
        raise ValueError(f"job={cfg.job!r} is not a job; choose one of {list(JOBS)}")
    for key in ("num_steps", "batch_size", "n_samples_per_prompt", "max_response_len", "max_context_len"):
        if key == "num_steps" and cfg.job == "eval":
            continue  # job=eval runs no steps
        if cfg.rollout[key] is not None and cfg.rollout[key] <= 0:
            raise ValueError(f"rollout.{key} must be positive, got {cfg.rollout[key]}")
    check_context_len(cfg.rollout.max_response_len, cfg.rollout.max_context_len)
    if cfg.rollout.history not in ("tokens", "render"):
        raise ValueError(f"rollout.history={cfg.rollout.history!r}; choose tokens or render")
    over = cfg.rollout.over_sampling_batch_size
    if over is not None and over < cfg.rollout.batch_size:
        raise ValueError(f"rollout.over_sampling_batch_size={over} must be at least rollout.batch_size "
                         f"({cfg.rollout.batch_size}) or null")
    if cfg.runtime.concurrency is not None and cfg.runtime.concurrency <= 0:
        raise ValueError(f"runtime.concurrency must be positive, got {cfg.runtime.concurrency}")
    _check_multi_context(cfg)
    _check_eval(cfg)
    _check_executor(cfg.agent)
    _check_gateway(cfg.gateway, cfg.protocol.service_prefix)


def multi_context_missing(cfg: DictConfig) -> list[str]:
    """The settings a run lacks for sessions that export several contexts (empty when it has them all)."""
    missing = []
    if not getattr(get_class(cfg.credit._target_), "several_contexts", False):
        missing.append("credit=custom_advantage")
    if not cfg.trainer.batching.use_dynamic_batch_size:
        missing.append("trainer.batching.use_dynamic_batch_size=true")
    return missing


def _check_multi_context(cfg: DictConfig) -> None:
    if not cfg.agent.get("multi_context"):
        return
    missing = multi_context_missing(cfg)
    if missing:
        raise ValueError(f"agent.multi_context=true (sessions export several contexts) needs {' and '.join(missing)}; "
                         "set them, or agent.multi_context=false if each session exports one context")


def _check_executor(agent: DictConfig) -> None:
    executor = agent.get("executor", "local")
    if executor not in AGENT_EXECUTORS:
        raise ValueError(f"agent.executor={executor!r} is not an executor; choose one of {list(AGENT_EXECUTORS)}")
    for key, value in (agent.get("resources") or {}).items():
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(f"agent.resources.{key}={value!r} must be a number >= 0 (what one session holds)")
    if executor == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError("agent.executor=ray needs Ray: pip install 'relax_pipeline[ray]' (ray[default]==2.60.0); "
                         "or use agent.executor=local")
    if executor == "http" and not agent.get("server_url"):
        raise ValueError("agent.executor=http needs agent.server_url (the agent server's base URL, for example "
                         "http://127.0.0.1:8700); or use agent.executor=local")


def _check_gateway(gateway: DictConfig, service_prefix: str) -> None:
    """The bind (`gateway.allow_remote` for a non-loopback host) and `gateway.public_url`'s form."""
    check_bind(gateway.host, gateway.port, gateway.allow_remote)
    if gateway.public_url is not None:
        check_public_url(gateway.public_url, service_prefix)


def _check_eval(cfg: DictConfig) -> None:
    ev = cfg.eval
    for key, value in (("eval.interval", ev.interval), ("eval.n_samples_per_prompt", ev.n_samples_per_prompt),
                       ("runtime.eval_concurrency", cfg.runtime.eval_concurrency)):
        if value is not None and value <= 0:
            raise ValueError(f"{key} must be positive or null, got {value}")
    if cfg.job == "eval" and not ev.datasets:
        raise ValueError("job=eval evaluates the eval.datasets entries and there are none: set "
                         "eval.datasets=[{name:NAME,path:FILE.jsonl}]")
    if ev.interval is not None and not ev.datasets:
        raise ValueError(f"eval.interval={ev.interval} needs at least one eval dataset: set "
                         "eval.datasets=[{name:NAME,path:FILE.jsonl}], or eval.interval=null")
    names: set[str] = set()
    for i, entry in enumerate(ev.datasets):
        for key in ("name", "path"):
            if OmegaConf.is_missing(entry, key):
                raise ValueError(f"eval.datasets[{i}].{key} is required (name: metrics eval/<name>/...; path: JSONL)")
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
