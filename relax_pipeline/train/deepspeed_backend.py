"""`trainer=deepspeed`: the torch trainer's step loop on a DeepSpeed engine with ZeRO stage 0-3.

`DeepSpeedTrainer` takes `DeepSpeedSettings` (the shared trainer record plus the ZeRO stage and ranks) and has
`TorchTrainer`'s methods; it runs the same per-micro-batch code
(`step.optimizer_step`); only the model wrapper, backward, optimizer step, weight gathering and
checkpoint format differ. The optimizer is torch's AdamW handed to `deepspeed.initialize` (nothing to
compile; DeepSpeed's CPU Adam would cost a build for no gain at these sizes).

Gradient accumulation: DeepSpeed fixes `gradient_accumulation_steps` at init, but a global batch packs
into a varying number of micro-batches (dynamic batching, a short last step). So the engine is built
with `gradient_accumulation_steps=1` and the trainer owns the boundary: before each backward it calls
`set_gradient_accumulation_boundary(last)` (False for all but the last micro-batch of the step), calls
`engine.backward(loss, scale_wrt_gas=False)` (the loss is already divided by the global batch's
normalizers, so no extra scaling is wanted) and calls `engine.step()` once per global batch. Gradient
clipping is DeepSpeed's (`gradient_clipping = trainer.optim.grad_clip`); the reported grad norm is the engine's
(ZeRO 1-3) or measured before the step (stage 0, where DeepSpeed does not record it).

Weights for the engine: stages 0-2 keep full parameters on every rank, so `engine_weights` copies the
module's state dict; under ZeRO-3 the parameters are partitioned and are gathered first with
`deepspeed.zero.GatheredParameters` (read-only, `modifier_rank=None`). Checkpoints hold the same files
as the torch backend's (a loadable Hugging Face folder: `model.safetensors` of the gathered weights beside
the model path's config and tokenizer files; version, RNG states, `extra`) with the optimizer and
partitioned states in DeepSpeed's own format (`engine.save_checkpoint`, tag `deepspeed`), which resumes
only with the same world size. With `save_optimizer=false` the DeepSpeed files are not written; loading
such a folder puts its weights into the module (gathered under ZeRO-3), refreshes the optimizer's fp32
master copies from them (`refresh_fp32_params`, ZeRO 1-3) and starts the optimizer state fresh.

Process group: with one rank, when no launcher set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
they are set for a single process (a free port on 127.0.0.1) and restored by `close()`, which also
destroys the process group this trainer created. Without CUDA, `DS_ACCELERATOR=cpu` and the gloo backend
are used, NCCL with CUDA. `TORCH_EXTENSIONS_DIR` defaults to `<relax cache>/torch_extensions` so
DeepSpeed's one-time op builds (the CPU shm comm op) are reused across runs and tests.

Several ranks (`trainer.num_ranks` N > 1): the trainer built by the run is rank 0 and starts ranks 1..N-1 as
`WorkerTrainer`s: processes of this machine (rank_group.py, rank_worker.py; chosen over torchrun, which would
have to start the whole run N times), or with `trainer.rank_placement=ray` Ray actors on any node of the cluster
at `ray.address` (rank_ray.py: MASTER_ADDR is then rank 0's address on the cluster; Ray stays an extra only
those runs need). Every call that involves DeepSpeed collectives (`train`, `engine_weights` under
ZeRO-3, `save`, `load`, construction) is sent to the workers first and then run on rank 0, in the same
order on every rank. `train` splits each global batch with `data_parallel.shard` (sample i to rank i mod
N, padding micro-batches so every rank runs the same passes) and ships each worker its `RankShare`s over
its control channel; the normalizers are the global batch's, whitening and metrics are reduced across
ranks, and the loss is scaled by N before backward because DeepSpeed averages gradients over ranks, so one
step equals the one-rank step up to float summation order. Checkpoints: rank 0 writes the Hugging Face
folder and the trainer state; every rank writes its part of DeepSpeed's files (`save_checkpoint`, which
resumes only with the same N). Weights for the engine come from rank 0 (gathered from every rank under
ZeRO-3). A worker that raises or dies fails the call with `RankFailed` naming the rank, its exit code and
its log; `close()` stops every worker.

What it does not do: vision-language models (a model folder with a `vision_config`, such as
`model=tiny_vl`, is refused at construction: its `multimodal_train_inputs` are untested under ZeRO; use
`trainer=torch`), ranks started by an outside launcher (a launcher's WORLD_SIZE > 1 is refused naming
`trainer.num_ranks`), CPU offload, mixed precision, or pipeline/tensor parallelism. `trainer.device` is not
used: the device is DeepSpeed's accelerator device for LOCAL_RANK.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from relax_pipeline.engine.base import AdapterWeights
from relax_pipeline.forest.sample import Sample
from relax_pipeline.infra.ports import free_port
from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights
from relax_pipeline.models.spec import is_multimodal
from relax_pipeline.models.tiny import default_cache_dir
from relax_pipeline.train.data_parallel import RankShare, shard
from relax_pipeline.train.lora import adapter_weights, load_adapter, save_adapter, trainable, wrap
from relax_pipeline.train.optim import adamw
from relax_pipeline.train.rank_group import RankFailed, RankGroup
from relax_pipeline.train.rank_ray import RayRankGroup
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun
from relax_pipeline.train.step import Frozen, share_step
from relax_pipeline.train.torch_backend import (
    TorchTrainer,
    cpu_state_dict,
    fresh_optimizer_warning,
    frozen_copy,
    load_policy,
    load_teacher,
    load_weights,
    write_state,
)

DS_TAG = "deepspeed"
"""Tag (sub-folder) of DeepSpeed's own files inside a checkpoint folder."""
RANK_LOG_FOLDER = "trainer_ranks"
"""Sub-folder of the run's output folder holding the worker ranks' logs."""


class DeepSpeedTrainer(TorchTrainer):
    """`TorchTrainer` whose model and optimizer live in a DeepSpeed engine (ZeRO `zero_stage`); with
    `num_ranks` N > 1 this process is rank 0 and drives N - 1 worker ranks (rank_group.py)."""

    one_thread = False
    """Training stays on the caller's thread (DeepSpeed's collectives and CUDA device are set up there)."""

    def __init__(self, settings: DeepSpeedSettings, run: TrainerRun) -> None:
        self.num_ranks = settings.num_ranks
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
        if gpus is not None and self.num_ranks > gpus:
            raise ValueError(f"trainer.num_ranks={self.num_ranks} but {gpus} GPUs are visible; use at most {gpus}")
        self.zero_stage = settings.zero_stage
        self.rank_log_dir = Path(run.output_dir) / RANK_LOG_FOLDER if run.output_dir else None
        """Where worker ranks write `rank<r>.log` (`<output_dir>/trainer_ranks`); None: a fresh temporary folder."""
        self.ranks: RankGroup | RayRankGroup | None = None
        self.rank_placement = settings.rank_placement
        """`trainer.rank_placement`: ranks 1..N-1 as local processes (`local`) or Ray actors (`ray`)."""
        super().__init__(settings, run)

    @property
    def settings_for_ranks(self) -> tuple[DeepSpeedSettings, TrainerRun]:
        """The constructor's records, sent to every worker rank (without the output folder: workers log where rank 0
        tells them)."""
        return self.trainer_settings, replace(self.run_settings, output_dir=None)

    def _setup(self, device: str, needs_reference: bool) -> None:
        """Process group, worker ranks, policy (+ reference), torch AdamW, `deepspeed.initialize`; undone if
        any part fails."""
        if is_multimodal(self.model_path):
            raise ValueError(f"trainer=deepspeed does not train vision-language models (model path {self.model_path} "
                             "needs multimodal_train_inputs); use trainer=torch")
        self._owns_group = False
        self._owned_env = self._environment()
        try:
            self._start_ranks()
            with self._collective("start-up", send=False):
                self._build(needs_reference)
        except BaseException:
            self.close()
            raise

    def _environment(self) -> dict[str, str | None]:
        """Rank 0's launcher variables; the previous values, restored by `close`."""
        on_ray = self.rank_placement == "ray" and self.num_ranks > 1
        return prepare_environment(self.num_ranks, rank0_address(self.run_settings.ray) if on_ray else "127.0.0.1")

    def _start_ranks(self) -> None:
        if self.num_ranks > 1 and self.rank_placement == "ray":
            self.ranks = RayRankGroup.start(self.num_ranks, WorkerTrainer, self.settings_for_ranks,
                                            self.trainer_settings.rank_resources, self.run_settings.ray,
                                            self.rank_log_dir)
        elif self.num_ranks > 1:
            log_dir = self.rank_log_dir or Path(tempfile.mkdtemp(prefix="relax-trainer-ranks-"))
            self.ranks = RankGroup.start(self.num_ranks, self.settings_for_ranks, log_dir)

    def _build(self, needs_reference: bool) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self._owns_group = init_process_group(deepspeed)
        self.device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
        policy, self.pad_id = load_policy(self.model_path, self.seed, str(self.device), self.attn_implementation,
                                          self.trainer_settings.lean_activations, self.base_dtype)
        self.reference = frozen_copy(policy) if needs_reference else None
        self.teacher = load_teacher(self.trainer_settings.teacher, policy, self.device)
        policy = wrap(policy, self.lora) if self.lora.enabled else policy
        optimizer = adamw(trainable(policy), self.optim)
        if self.zero_stage == 3 and self.num_ranks > 1:
            restart_zero3_ids()
        config = ds_config(self.zero_stage, self.optim.grad_clip, self.settings.batching.micro_batch_size)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
        self.model: Any = self.engine
        self.policy = self.engine.module

    @contextmanager
    def _collective(self, command: str, *args: Any, per_rank: Sequence[Any] | None = None,
                    send: bool = True) -> Iterator[None]:
        """Send the worker ranks `command` (unless `send` is False: they are already on it), run rank 0's part
        (the body), wait for every worker; a failure on a worker raises `RankFailed` naming it."""
        if self.ranks is None:
            yield
            return
        if send:
            self.ranks.send(command, *args, per_rank=per_rank)
        try:
            yield
        except Exception as err:
            try:
                self.ranks.diagnose(command)
            except RankFailed as failed:
                raise failed from err
            raise
        self.ranks.collect(command)

    # ---- training -------------------------------------------------------------------------------

    def _steps(self, batches: list[list[Sample]]) -> list[dict[str, float]]:
        """One rank: the torch trainer's steps. N ranks: each global batch split by `data_parallel.shard`,
        every worker sent its shares, rank 0 runs share 0."""
        if self.ranks is None:
            return super()._steps(batches)
        shares = [shard(b, self.num_ranks, self.settings.batching, self.version) for b in batches]
        per_rank = [[s[rank] for s in shares] for rank in range(1, self.num_ranks)]
        with self._collective("train", per_rank=per_rank):
            metrics = self.run_shares([s[0] for s in shares])
        return metrics

    def run_shares(self, shares: list[RankShare]) -> list[dict[str, float]]:
        """This rank's part of each optimizer step (every rank runs it with the same number of shares)."""
        frozen = Frozen(self.reference, self.teacher)
        self.timeline = [[] for _ in shares]
        return [share_step(self.model, frozen, self, share, self.settings, self.pad_id, self.device, self._all_sum,
                           self.timeline[i]) for i, share in enumerate(shares)]

    def _all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """all-reduce SUM over every rank (on this rank's device: NCCL reduces only GPU tensors)."""
        tensor = values.to(self.device)
        torch.distributed.all_reduce(tensor)
        return tensor.cpu()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate locally; reduce (and step) only at the step's last micro-batch. The loss is scaled by
        the number of ranks because DeepSpeed averages the gradients over ranks: the result is their sum."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.num_ranks, scale_wrt_gas=False)

    def step(self) -> float:
        """DeepSpeed's clip + AdamW step + zero grad; the grad norm before clipping."""
        measured = self._stage0_norm() if self.zero_stage == 0 else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else (measured or 0.0))

    def _stage0_norm(self) -> float:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    # ---- weights and checkpoints ----------------------------------------------------------------

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU weights; under ZeRO-3 gathered from the partitions of every rank first."""
        if self.zero_stage < 3:
            return self.gathered_weights()
        with self._collective("gather"):
            weights = self.gathered_weights()
        return weights

    def gathered_weights(self) -> dict[str, torch.Tensor]:
        """This rank's part of `engine_weights` (a collective under ZeRO-3, a local copy below it)."""
        return self._gathered(lambda: cpu_state_dict(self._full_state()))

    def _gathered(self, read: Callable[[], Any]) -> Any:
        """`read()` with every parameter whole: under ZeRO-3 inside one gather of all of them (the same collective
        on every rank), below it as is."""
        if self.zero_stage < 3:
            return read()
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.policy.parameters()), modifier_rank=None):
            return read()

    def engine_adapter(self) -> AdapterWeights | None:
        """Under LoRA the adapter (gathered from every rank's partitions under ZeRO-3); None otherwise."""
        if not self.lora.enabled:
            return None
        if self.zero_stage < 3:
            return adapter_weights(self.policy)
        with self._collective("gather"):
            adapter = self._gathered(lambda: adapter_weights(self.policy))
        return adapter

    def _write_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        """Rank 0 writes the Hugging Face folder and the state; every rank writes its DeepSpeed files."""
        with self._collective("save", str(folder)):
            copy_model_files(Path(self.model_path), folder)
            if self.lora.enabled:
                self._gathered(lambda: save_adapter(self.policy, folder))
            else:
                save_weights(self.gathered_weights(), folder / WEIGHTS_FILE)
            if self.save_optimizer:
                self._save_engine(str(folder))
            write_state(folder, self.version, extra)

    def _save_engine(self, folder: str) -> None:
        """DeepSpeed's files (optimizer, partitions); under LoRA without the frozen base weights."""
        self.engine.save_checkpoint(folder, tag=DS_TAG, exclude_frozen_parameters=self.lora.enabled)

    def save_part(self, folder: str) -> None:
        """A worker rank's part of `_write_checkpoint`: the same collectives, its own DeepSpeed files."""
        if self.zero_stage == 3:
            self.gathered_weights()
        if self.save_optimizer:
            self._save_engine(folder)

    def load(self, path: Path | str) -> dict[str, Any]:
        """Restore the engine (weights, optimizer, ZeRO partitions) on every rank, version and RNG states; a
        folder saved without optimizer state restores the weights only."""
        path = Path(path)
        with self._collective("load", str(path)):
            self._load_engine(path)
            extra = self._read_state(path)
        return extra

    def _load_engine(self, path: Path) -> None:
        if not (path / DS_TAG).is_dir():
            self._load_weights_only(path)
            return
        loaded, _ = self.engine.load_checkpoint(str(path), tag=DS_TAG, load_lr_scheduler_states=False,
                                                load_module_strict=not self.lora.enabled)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path / DS_TAG}")

    def _load_weights_only(self, path: Path) -> None:
        """Weights into the module (gathered under ZeRO-3), then the optimizer's fp32 copies refreshed."""
        import deepspeed

        params = list(self.policy.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self.zero_stage == 3):
            if self.lora.enabled:
                load_adapter(self.policy, path)
            else:
                load_weights(self.policy, path / WEIGHTS_FILE)
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()
        fresh_optimizer_warning(path)

    def close(self) -> None:
        """Stop the worker ranks, destroy the process group this trainer created, restore the environment."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self._owns_group and torch.distributed.is_initialized():
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups
        self._owns_group = False
        restore_environment(self._owned_env)
        self._owned_env = {}


class WorkerTrainer(DeepSpeedTrainer):
    """Rank 1..N-1 (rank_worker.py): the same engine in a process rank 0 started with the launcher
    variables set; it starts no ranks and sends no commands of its own."""

    def _environment(self) -> dict[str, str | None]:
        missing = [key for key in (*LAUNCH_KEYS, "MASTER_PORT") if key not in os.environ]
        if missing:
            raise RuntimeError(f"a worker rank needs {missing} set by rank 0's RankGroup")
        return {}

    def _start_ranks(self) -> None:
        """Workers start no ranks."""


def restart_zero3_ids() -> None:
    """Number this engine's ZeRO-3 modules and parameters from 0, as a fresh worker process does.

    DeepSpeed counts them process-wide (the module counter is a mutable default argument of
    `DeepSpeedZeRoOffload._register_deepspeed_module`, the parameter counter `zero.Init.param_id`) and
    checks on every forward that all ranks traced the same ids; rank 0 of a process that built an earlier
    engine (tests, runs in one process) would otherwise start above its workers and fail that check.
    """
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    defaults = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__ or ()
    for counter in defaults:
        if isinstance(counter, list) and counter and isinstance(counter[0], int):
            counter[0] = 0
    Init.param_id = 0


def ds_config(zero_stage: int, grad_clip: float, micro_batch_size: int) -> dict[str, Any]:
    """The `deepspeed.initialize` config: float32, ZeRO `zero_stage`, accumulation owned by the trainer."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")
"""torch.distributed's launcher variables besides MASTER_PORT."""


def rank0_address(ray_settings: dict[str, Any] | None) -> str:
    """Rank 0's address on the Ray cluster (MASTER_ADDR of ranks placed there), joining it if needed."""
    from relax_pipeline.infra import ray_runtime

    ray_runtime.connect(ray_settings)
    return ray_runtime.node_ip()


def prepare_environment(num_ranks: int = 1, master_addr: str = "127.0.0.1") -> dict[str, str | None]:
    """Set rank 0's launcher variables for `num_ranks` ranks (reaching rank 0 at `master_addr`); return each
    changed key's previous value.

    One rank keeps what a launcher set (a free port otherwise); several ranks are started by this process,
    so a launcher's WORLD_SIZE > 1 is refused (each launched process would start its own ranks).
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir() / "torch_extensions"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(
            f"trainer=deepspeed starts its own ranks (trainer.num_ranks); WORLD_SIZE={world} from a launcher is "
            "not supported: run one process and set trainer.num_ranks instead"
        )
    wanted = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(num_ranks), "MASTER_ADDR": master_addr}
    if num_ranks == 1:
        wanted = {k: v for k, v in wanted.items() if k not in os.environ}
    if num_ranks > 1 or "MASTER_PORT" not in os.environ:
        wanted["MASTER_PORT"] = str(free_port())
    previous = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    return previous


def restore_environment(previous: dict[str, str | None]) -> None:
    """Put back the values `prepare_environment` replaced (removing the keys that were unset)."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def init_process_group(deepspeed: Any) -> bool:
    """Initialize torch.distributed through DeepSpeed (gloo without CUDA); True when this call created it."""
    if torch.distributed.is_initialized():
        return False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return True
