"""The `engine` node as records: one per `engine=` option, declared once, plus what every engine gets from the run.

`HFEngineSettings` (`engine=hf`, the embedded engine), `SglangEngineSettings` (`engine=sglang`, SGLang servers over
HTTP) and `ScriptEngineSettings` (`engine=scripted`, the fake in `testing/`) are the options' schemas; each one's
`_target_` names the class it builds, and each checks its own keys when it is made, naming the key and the
allowed values. `SglangEngineSettings` keeps the documented flat keys (`engine.launch`, `engine.router`,
`engine.admission`, ...: CLI keys users type, design §3.1) and groups them in code as small records
(`launch_part`, `router_part`, `admission_part`, `program_part`, `placement_part`, `weights_part`,
`sessions_part`) so the launch, routing, admission, placement, weight and session code each read only theirs.
`EngineRun` is what an engine gets from the rest of the run: the model folder, the seed, the context length
the model allows, the template's end-of-turn token, the output folder and the Ray cluster.

What it does not do: build engines or import torch. The recipes (`recipes/parts.py`) hand these records to the class
`_target_` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
"""`engine.dtype` values of the embedded engine."""
ROUTERS = ("none", "smg")
"""`engine.router`: the client routes by cache affinity itself, or smg (Shepherd Model Gateway) is in front."""
WEIGHT_UPDATES = ("abort", "pause")
"""`engine.weight_update` of engine=sglang: generations are aborted and resumed around an update, or paused in place."""
WEIGHT_TRANSFERS = ("disk", "tensor", "distributed")
"""`engine.weight_transfer` of engine=sglang: how new weights reach the servers (engine/sglang/weights.py)."""
WEIGHT_BACKENDS = ("nccl", "gloo")
"""`engine.weight_backend` of weight_transfer=distributed (null: nccl with CUDA, else gloo)."""
ADMISSIONS = ("none", "kv", "program")
"""`engine.admission` of engine=sglang: none, KV-aware admission per request, or per agent session (program)."""
HF_ADMISSIONS = ("none", "program")
"""`engine.admission` of engine=hf: none, or per agent session against its prefix cache (program)."""
IMAGE_MISMATCHES = ("count", "refuse")
"""`engine.image_mismatch` of engine=sglang: an image prompt SGLang re-tokenized to another length is counted or
refused."""
PLACEMENTS = ("local", "ray")
"""Where launched servers run (`engine.placement`): subprocesses here, or placement-group bundles of a Ray cluster."""


@dataclass(frozen=True)
class EngineRun:
    """What an engine gets from the run besides its node; built once by `recipes/parts.py`."""

    model_path: str
    """The model's Hugging Face folder (`model.path`, or the built model)."""
    seed: int = 0
    """The run's `seed`: each request's sampling generator derives from it."""
    max_context_len: int = 4096
    """Most tokens of a prompt plus its response (`rollout.max_context_len`, or the model's own maximum)."""
    end_of_turn: str | None = None
    """`model.end_of_turn`: the template's end-of-turn token (None: detected from the chat template)."""
    output_dir: str | None = None
    """The run's output folder (launched servers' logs and weights); None: a temporary folder."""
    ray: dict[str, Any] | None = None
    """The run's `ray.*` keys, for servers placed on a Ray cluster."""


@dataclass
class HFEngineSettings:
    """`engine=hf`: the embedded transformers engine (engine/hf/engine.py)."""

    _target_: str = "relax_pipeline.engine.hf.HFEngine"
    """The engine class this node builds."""
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
    admission: str = "none"
    """none, or program: admit each agent session by its predicted KV use against the prefix cache's capacity
    (kv_cache_mb in tokens) before its turns run (engine/program_admission.py)."""
    kv_headroom: float = 0.9
    """admission=program: fraction of the KV capacity that admitted sessions may lease."""
    admission_max_wait_s: float = 300.0
    """admission=program: longest wait for room; then the session starts anyway (agentic_kv/timeouts)."""
    admission_lease_s: float = 600.0
    """admission=program: a session idle this long (no turn running) loses its lease (a dead agent holds no room)."""
    admission_growth_prior: int = 1024
    """admission=program: tokens a session is expected to add past its first prompt until a session finished."""

    @property
    def program_part(self) -> ProgramPart | None:
        """None unless engine.admission=program."""
        return program_part(self.admission, self.kv_headroom, self.admission_max_wait_s, self.admission_lease_s,
                            self.admission_growth_prior)

    def __post_init__(self) -> None:
        check_choice("engine.admission", self.admission, HF_ADMISSIONS)
        check_admission(self.kv_headroom, self.admission_max_wait_s, self.admission_lease_s,
                        self.admission_growth_prior)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"engine.threads={self.threads} must be >= 1 (or null: torch's default)")
        if self.kv_cache_mb < 0:
            raise ValueError(f"engine.kv_cache_mb={self.kv_cache_mb} must be >= 0 (0 turns the prefix cache off)")
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.dtype={self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size={self.max_batch_size} must be >= 1")


@dataclass
class ScriptEngineSettings:
    """`engine=scripted`: a fake engine replaying a JSONL script of assistant turns (testing/script_engine.py)."""

    script: str
    """JSONL, one assistant turn a line: {"content", "reasoning", "tool_calls": [{"name", "arguments"}],
    "finish": "stop"|"length"}, all optional; every session replays it from line 1, then answers "done."."""
    _target_: str = "relax_pipeline.testing.script_engine.ScriptEngine"
    """The engine class this node builds."""
    max_batch_size: int = 32
    """Sessions job=eval keeps in flight by default (as engine=hf's batch)."""


@dataclass(frozen=True)
class LaunchPart:
    """engine.launch=true: the servers to start and how (engine/sglang/launch.py)."""

    servers: int
    gpus_per_server: int
    command: str
    server_args: dict[str, Any]
    timeout: float
    host: str


@dataclass(frozen=True)
class RouterPart:
    """engine.router=smg: smg in front of the servers (engine/sglang/smg.py)."""

    url: str | None
    command: str
    args: dict[str, Any]


@dataclass(frozen=True)
class AdmissionPart:
    """engine.admission=kv: room reserved against each worker's KV capacity (engine/sglang/routing.py)."""

    headroom: float
    max_wait_s: float


@dataclass(frozen=True)
class ProgramPart:
    """engine.admission=program: whole agent sessions admitted by predicted KV use (engine/program_admission.py)."""

    headroom: float
    max_wait_s: float
    lease_s: float
    growth_prior: int


@dataclass(frozen=True)
class WeightsPart:
    """How new weights reach the servers and how running generations meet them (engine/sglang/weights.py)."""

    update: str
    transfer: str
    backend: str | None
    master_address: str | None


@dataclass(frozen=True)
class SessionsPart:
    """engine.sessions=true: SGLang sessions (engine/sglang/sessions.py) and what to do on servers without
    `--enable-session-radix-cache`."""

    timeout_s: float | None
    fallback: bool


@dataclass(frozen=True)
class PlacementPart:
    """engine.placement=ray: one placement-group bundle per launched server (engine/sglang/placement.py)."""

    strategy: str
    cpus_per_server: float


@dataclass
class SglangEngineSettings:
    """`engine=sglang`: SGLang servers over their native HTTP API (engine/sglang/client.py); connect or launch."""

    _target_: str = "relax_pipeline.engine.sglang.SglangEngine"
    """The engine class this node builds."""
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
    """none (the client routes by cache affinity itself) or smg (the smg gateway in front: generations go through
    it, sticky by routing key; pause, continue and weight loads fan out through its RL control plane)."""
    router_url: str | None = None
    """A running smg (started with --policy manual, and --enable-rl for its control plane); None starts one with
    router_command."""
    router_command: str = "python -m smg.launch_router"
    """Command of the router; host, port, --worker-urls, --policy manual, --enable-rl and router_args are appended."""
    router_args: dict[str, Any] = field(default_factory=dict)
    """Extra router flags, as server_args."""
    admission: str = "none"
    """none; kv: reserve prompt + max_new_tokens against the worker's KV capacity before each request; program:
    admit each agent session by its predicted KV use (its context + the growth learned from finished sessions of
    its task) against the servers' max_total_num_tokens and load (engine/program_admission.py)."""
    kv_headroom: float = 0.9
    """admission=kv|program: fraction of the reported KV capacity (max_total_num_tokens) that may be reserved."""
    admission_max_wait_s: float = 300.0
    """admission=kv|program: longest wait for room; then the request (session) starts anyway (counted in
    engine/admission_timeouts, agentic_kv/timeouts)."""
    admission_lease_s: float = 600.0
    """admission=program: a session idle this long (no turn running) loses its lease (a dead agent holds no room)."""
    admission_growth_prior: int = 1024
    """admission=program: tokens a session is expected to add past its first prompt until a session finished."""
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
    on the Ray cluster at ray.address, engine/sglang/placement.py); null: ray when ray.address is set, else local."""
    placement_strategy: str = "PACK"
    """placement=ray: how bundles spread over nodes (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    cpus_per_server: float = 1.0
    """placement=ray: CPUs each server's bundle holds (besides gpus_per_server GPUs)."""
    sessions: bool = True
    """One SGLang session per agent session (`/open_session` at its first turn, `session_params` on every turn,
    `/close_session` when it ends): its KV stays on the server between turns, tool calls included, and is released
    and dereferenced at the end (SGLang's `--enable-session-radix-cache`: referenced KV is evicted after
    unreferenced KV, a closed session's KV stays cached until evicted); turns send only their new tokens. Launched
    servers get the flag; running ones must report it in /server_info (see sessions_fallback). false: every turn is
    a plain request."""
    sessions_fallback: bool = False
    """sessions=true against running servers without `--enable-session-radix-cache`: false refuses at start (naming
    the fix); true says so once and runs with sessions=false (their KV is ordinary, evictable cache)."""
    image_mismatch: str = "count"
    """An image turn SGLang served with another prompt length than ours (it re-tokenizes image prompts): count (warn
    once; the step metric engine/image_token_mismatches) or refuse (the turn fails, naming this key)."""
    weight_update: str = "abort"
    """abort: the runtime aborts running generations before a weight update and resumes them after (re-prefilled);
    pause: `/pause_generation` (in place) → load → `/continue_generation`, so they keep their KV and go on with
    the new weights, each token keeping the version that sampled it."""
    session_timeout_s: float | None = 3600.0
    """sessions=true: seconds a session may stay idle before SGLang closes it itself (a session nobody closed);
    set it to at least `agent.timeout`. null: no timeout."""
    weight_transfer: str = "disk"
    """How new weights reach the servers: disk (a Hugging Face folder under weights_dir, `/update_weights_from_disk`;
    the servers must read that storage), tensor (the tensors themselves in `/update_weights_from_tensor` requests,
    pickled CPU tensors in buckets: no shared storage needed), or distributed (`/init_weights_update_group` once, then
    `/update_weights_from_distributed` per bucket while this process broadcasts the tensors as rank 0 of a process
    group with every server's ranks; engine/sglang/weights.py)."""
    weight_backend: str | None = None
    """weight_transfer=distributed: the process group's backend, nccl (GPU to GPU; the trainer's GPU must be none of
    the servers') or gloo (through host memory; the CPU tests); null: nccl where this process has CUDA, else gloo."""
    weight_master_address: str | None = None
    """weight_transfer=distributed: the address the servers reach this process at (rank 0 hosts the group's TCP
    store on a free port); null: the address this machine reaches the first server from."""

    def __post_init__(self) -> None:
        if self.router == "sglang":
            raise ValueError("engine.router='sglang': sglang-router (last release 0.3.2) is replaced by smg, its "
                             "maintained successor; set engine.router=smg (pip install -e '.[router]')")
        check_choice("engine.router", self.router, ROUTERS)
        check_choice("engine.admission", self.admission, ADMISSIONS)
        check_admission(self.kv_headroom, self.admission_max_wait_s, self.admission_lease_s,
                        self.admission_growth_prior)
        check_choice("engine.weight_update", self.weight_update, WEIGHT_UPDATES)
        check_choice("engine.weight_transfer", self.weight_transfer, WEIGHT_TRANSFERS)
        if self.weight_backend is not None:
            check_choice("engine.weight_backend", self.weight_backend, WEIGHT_BACKENDS)
        if bool(self.urls) == bool(self.launch):
            raise ValueError("engine=sglang needs exactly one of engine.urls=[http://HOST:PORT,...] (running SGLang "
                             "servers) and engine.launch=true (start engine.servers of them)")
        if self.launch and self.servers < 1:
            raise ValueError(f"engine.servers={self.servers} must be >= 1 with engine.launch=true")
        if self.router_url and self.router != "smg":
            raise ValueError("engine.router_url is set but engine.router=none; set engine.router=smg")
        check_choice("engine.image_mismatch", self.image_mismatch, IMAGE_MISMATCHES)
        if self.placement is not None:
            check_choice("engine.placement", self.placement, PLACEMENTS)
        if self.session_timeout_s is not None and self.session_timeout_s <= 0:
            raise ValueError(f"engine.session_timeout_s={self.session_timeout_s} must be positive (null: none)")
        if self.placement == "ray" and not self.launch:
            raise ValueError("engine.placement=ray places launched servers: set engine.launch=true (or "
                             "engine.placement=null to connect to engine.urls)")

    @property
    def launch_part(self) -> LaunchPart:
        return LaunchPart(self.servers, self.gpus_per_server, self.launch_command, dict(self.server_args),
                          self.launch_timeout, self.host)

    @property
    def router_part(self) -> RouterPart | None:
        """None with engine.router=none."""
        if self.router != "smg":
            return None
        url = self.router_url.rstrip("/") if self.router_url else None
        return RouterPart(url, self.router_command, dict(self.router_args))

    @property
    def weights_part(self) -> WeightsPart:
        return WeightsPart(self.weight_update, self.weight_transfer, self.weight_backend, self.weight_master_address)

    @property
    def sessions_part(self) -> SessionsPart | None:
        """None with engine.sessions=false."""
        return SessionsPart(self.session_timeout_s, self.sessions_fallback) if self.sessions else None

    @property
    def admission_part(self) -> AdmissionPart | None:
        """None with engine.admission=none."""
        return AdmissionPart(self.kv_headroom, self.admission_max_wait_s) if self.admission == "kv" else None

    @property
    def program_part(self) -> ProgramPart | None:
        """None unless engine.admission=program."""
        return program_part(self.admission, self.kv_headroom, self.admission_max_wait_s, self.admission_lease_s,
                            self.admission_growth_prior)

    def placement_part(self, ray: dict[str, Any] | None) -> PlacementPart | None:
        """engine.placement resolved against the run's `ray.*` keys (null: ray when launching with a
        `ray.address`); None for servers that are not placed on Ray."""
        placement = self.placement
        if placement is None:
            placement = "ray" if self.launch and (ray or {}).get("address") else "local"
        return PlacementPart(self.placement_strategy, self.cpus_per_server) if placement == "ray" else None


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """`value` is one of `allowed`, else an error naming `key` and the choices."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r}; choose one of {list(allowed)}")


def check_admission(headroom: float, max_wait_s: float, lease_s: float, growth_prior: int) -> None:
    """The admission keys' ranges, each error naming its key."""
    if not 0 < headroom <= 1:
        raise ValueError(f"engine.kv_headroom={headroom} must lie in (0, 1] (the fraction of the KV capacity leased)")
    if max_wait_s <= 0:
        raise ValueError(f"engine.admission_max_wait_s={max_wait_s} must be positive (seconds)")
    if lease_s <= 0:
        raise ValueError(f"engine.admission_lease_s={lease_s} must be positive (seconds a session may sit idle)")
    if growth_prior < 0:
        raise ValueError(f"engine.admission_growth_prior={growth_prior} must be >= 0 (tokens)")


def program_part(admission: str, headroom: float, max_wait_s: float, lease_s: float,
                 growth_prior: int) -> ProgramPart | None:
    """The program admission's part; None unless `admission` is program."""
    return ProgramPart(headroom, max_wait_s, lease_s, growth_prior) if admission == "program" else None
