"""The `trainer` node as records: what `TorchTrainer` and `DeepSpeedTrainer` take, declared once.

`TrainerSettings` is the node both backends share (`trainer=torch`'s whole schema): the device, the nested
`loss`, `batching`, `optim` and `lora` records, precision and memory switches, and the checkpoint schedule that the
step loop reads (`checkpoint_part`). `DeepSpeedSettings` adds the keys only `trainer=deepspeed` reads (ZeRO
stage, ranks and where they run), so `trainer=torch trainer.zero_stage=2` fails when the config is composed.
`TrainerRun` carries what the trainer must agree on with the other groups (model path, seed, the rollout's
temperature, the credit's advantage settings) and where the run lives (output folder, Ray cluster); `recipes/parts.py`
builds it once. Each record checks its own keys when it is made, naming the key and the allowed values.

What it does not do: build anything. These are data; the config schema (`config.py`) composes them and
`recipes/parts.py` hands them to the trainer class their `_target_` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.credit.settings import AdvantageSettings
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.lora import LoraSettings
from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.optim import OptimSettings

RANK_PLACEMENTS = ("local", "ray")
"""Where ranks 1..N-1 of `trainer.num_ranks` run."""


@dataclass
class CheckpointSettings:
    """The checkpoint schedule (`loop.Checkpoints`); its keys sit directly under `trainer.`."""

    save_interval: int | None = None
    resume: bool = False
    checkpoint_dir: str | None = None
    keep_checkpoints: int | None = None


@dataclass
class TrainerSettings:
    """`trainer=torch`'s node and the part every backend reads; connects the `trainer` group to the trainer."""

    _target_: str = "relax_pipeline.train.torch_backend.TorchTrainer"
    """The trainer class this node builds (`recipes/parts.py` calls it with this record and a `TrainerRun`)."""
    device: str = "cpu"
    """torch device of the policy being trained."""
    loss: LossSettings = field(default_factory=LossSettings)
    """The policy loss (train/losses.py): PPO clipping, off-policy corrections, entropy bonus, reference KL."""
    batching: BatchSettings = field(default_factory=BatchSettings)
    """Optimizer steps and micro-batches (train/batching.py)."""
    optim: OptimSettings = field(default_factory=OptimSettings)
    """AdamW and gradient clipping (train/optim.py)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA (train/lora.py): with `trainer.lora.rank` set, a PEFT adapter is trained over frozen base weights and
    only the adapter is synced to the engine and checkpointed."""
    save_optimizer: bool = True
    """Save the optimizer state with each checkpoint; false saves weights only (a resume then restarts the
    optimizer and says so)."""
    autocast: str | None = None
    """Mixed precision for the forward and backward: `bfloat16` (or `float16`) under torch.autocast, weights
    and optimizer state in float32; null trains in float32 (logprobs then match a float32 engine's)."""
    attn_implementation: str | None = None
    """The policy's attention kernel: `eager`, `sdpa`, or `grouped` (models/attention.py: eager without copying
    the KV cache for each query head; on a CPU under bf16 autocast faster a step than sdpa, docs/benchmarks.md); null
    keeps transformers' default (sdpa)."""
    lean_activations: bool = True
    """Under autocast, the policy's norms and SwiGLU MLPs keep less for the backward (train/lean_layers.py: the same
    forward, gradients equal to rounding, about a fifth less activation memory); false keeps transformers' own."""
    teacher: str | None = None
    """Hugging Face folder of the distillation teacher (`trainer.loss.distill_coef` > 0): a frozen model sharing the
    policy's tokenizer, whose logprobs of the generated tokens the loss pulls the policy toward (reverse KL)."""
    keep_freed_memory: bool | None = None
    """Keep freed CPU memory mapped for reuse (glibc mallopt, train/allocator.py): large training tensors then
    skip the page faults of fresh memory, and the process keeps its peak size. Null: on for a CPU device. False
    on a CPU: a training run maps chunks of 4 MiB and more fresh, so its size follows what is live."""
    save_interval: int | None = None
    """Save a checkpoint every N steps (and at the end); None saves only at the end."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint_dir."""
    checkpoint_dir: str | None = None
    """Where checkpoints are written and resumed from; None means <output folder>/checkpoints."""
    keep_checkpoints: int | None = None
    """Keep only the last N checkpoint folders (older ones are deleted after each save); None keeps all."""

    def __post_init__(self) -> None:
        if (self.loss.distill_coef > 0) != (self.teacher is not None):
            raise ValueError(f"trainer.loss.distill_coef={self.loss.distill_coef} and "
                             f"trainer.teacher={self.teacher!r}: set both (a positive coefficient and the "
                             "teacher's folder) or neither")
        for key in ("save_interval", "keep_checkpoints"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"trainer.{key}={value} must be >= 1 or null")

    @property
    def checkpoint_part(self) -> CheckpointSettings:
        """The keys the step loop's checkpoint schedule reads."""
        return CheckpointSettings(self.save_interval, self.resume, self.checkpoint_dir, self.keep_checkpoints)


@dataclass
class DeepSpeedSettings(TrainerSettings):
    """`trainer=deepspeed`'s node: the shared part plus what only the DeepSpeed backend reads."""

    _target_: str = "relax_pipeline.train.deepspeed_backend.DeepSpeedTrainer"

    zero_stage: int = 2
    """DeepSpeed ZeRO stage, 0-3."""
    num_ranks: int = 1
    """Data-parallel training processes: the run is rank 0 and starts ranks 1..N-1, logging to
    <output>/trainer_ranks/rank<r>.log (train/rank_group.py)."""
    rank_placement: str = "local"
    """Where ranks 1..N-1 run (num_ranks > 1): `local` (processes of this machine) or `ray` (Ray actors on the
    cluster at ray.address, any node with room for rank_resources; train/rank_ray.py)."""
    rank_resources: dict[str, float] = field(default_factory=dict)
    """rank_placement=ray: what each rank holds ({num_gpus: 1} on GPU nodes, custom resources to pin nodes);
    empty: {num_cpus: 1}."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage={self.zero_stage}; choose 0, 1, 2 or 3")
        if not (isinstance(self.num_ranks, int) and self.num_ranks >= 1):
            raise ValueError(f"trainer.num_ranks={self.num_ranks!r}; use 1 or more")
        if self.rank_placement not in RANK_PLACEMENTS:
            raise ValueError(f"trainer.rank_placement={self.rank_placement!r}; choose one of "
                             f"{', '.join(RANK_PLACEMENTS)}")
        if self.rank_placement == "ray" and self.num_ranks == 1:
            raise ValueError("trainer.rank_placement=ray places ranks 1..N-1 on a Ray cluster; set trainer.num_ranks "
                             "to 2 or more, or leave rank_placement=local")


@dataclass(frozen=True)
class TrainerRun:
    """What the trainer agrees on with the other groups and where the run lives; built once by `recipes/parts.py`."""

    model_path: str
    """The policy's Hugging Face folder (`model.path`, or the built model)."""
    seed: int = 0
    """The run's `seed`: torch's init and the step's sampling of micro-batches."""
    temperature: float = 1.0
    """`rollout.temperature`: logprobs are computed at the temperature the engine sampled at."""
    advantages: AdvantageSettings = field(default_factory=AdvantageSettings)
    """The credit group's estimator, KL shaping and whitening (`credit.*`)."""
    output_dir: str | None = None
    """The run's output folder (worker ranks' logs); None: a temporary folder."""
    ray: dict[str, Any] | None = None
    """The run's `ray.*` keys, for ranks placed on a Ray cluster."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be >= 0 (0 is greedy)")
