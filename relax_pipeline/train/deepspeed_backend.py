"""`trainer=deepspeed`: the torch trainer's step loop on a DeepSpeed engine with ZeRO stage 0-3.

`DeepSpeedTrainer` has `TorchTrainer`'s constructor and methods and runs the same per-micro-batch code
(`step.optimizer_step`); only the model wrapper, backward, optimizer step, weight gathering and
checkpoint format differ. The optimizer is torch's AdamW handed to `deepspeed.initialize` (nothing to
compile; DeepSpeed's CPU Adam would cost a ~20 s build for no gain at these sizes).

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

Process group: when no launcher set RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, they are set
for a single process (a free port on 127.0.0.1) and removed again by `close()`, which also destroys the
process group this trainer created. Without CUDA, `DS_ACCELERATOR=cpu` and the gloo backend are used.
`TORCH_EXTENSIONS_DIR` defaults to `<relax cache>/torch_extensions` so DeepSpeed's one-time op builds
(the CPU shm comm op, ~40-70 s) are reused across runs and tests.

What it does not do: vision-language models (a model folder with a `vision_config`, such as
`model=tiny_vl`, is refused at construction: its `multimodal_train_inputs` are untested under ZeRO; use
`trainer=torch`), data-parallel sharding across several ranks (it refuses WORLD_SIZE > 1 naming the
gap), CPU offload, mixed precision, or pipeline/tensor parallelism. `trainer.device` is not used: the
device is DeepSpeed's accelerator device for LOCAL_RANK.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch

from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights
from relax_pipeline.models.spec import is_multimodal
from relax_pipeline.models.tiny import default_cache_dir
from relax_pipeline.train.optim import adamw
from relax_pipeline.train.torch_backend import (
    TorchTrainer,
    cpu_state_dict,
    fresh_optimizer_warning,
    frozen_copy,
    load_policy,
    load_weights,
    write_state,
)

DS_TAG = "deepspeed"
"""Tag (sub-folder) of DeepSpeed's own files inside a checkpoint folder."""


class DeepSpeedTrainer(TorchTrainer):
    """`TorchTrainer` whose model and optimizer live in a DeepSpeed engine (ZeRO `zero_stage`)."""

    def check_zero_stage(self, zero_stage: int) -> None:
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage={zero_stage}; choose 0, 1, 2 or 3")

    def _setup(self, device: str, needs_reference: bool) -> None:
        """Process group, policy (+ reference), torch AdamW, `deepspeed.initialize`; undone if any part fails."""
        if is_multimodal(self.model_path):
            raise ValueError(f"trainer=deepspeed does not train vision-language models (model path {self.model_path} "
                             "needs multimodal_train_inputs); use trainer=torch")
        self._owned_env = prepare_environment()
        self._owns_group = False
        try:
            self._build(needs_reference)
        except BaseException:
            self.close()
            raise

    def _build(self, needs_reference: bool) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        self._owns_group = init_process_group(deepspeed)
        self.device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
        policy, self.pad_id = load_policy(self.model_path, self.seed, str(self.device))
        self.reference = frozen_copy(policy) if needs_reference else None
        optimizer = adamw(policy.parameters(), self.optim)
        config = ds_config(self.zero_stage, self.optim.grad_clip, self.settings.batching.micro_batch_size)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config)
        self.model: Any = self.engine
        self.policy = self.engine.module

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate locally; reduce (and step) only at the step's last micro-batch."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """DeepSpeed's clip + AdamW step + zero grad; the grad norm before clipping."""
        measured = self._stage0_norm() if self.zero_stage == 0 else None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else (measured or 0.0))

    def _stage0_norm(self) -> float:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU weights; under ZeRO-3 gathered from the partitions first."""
        if self.zero_stage < 3:
            return cpu_state_dict(self.policy.state_dict())
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.policy.parameters()), modifier_rank=None):
            return cpu_state_dict(self.policy.state_dict())

    def _write_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        copy_model_files(Path(self.model_path), folder)
        save_weights(self.engine_weights(), folder / WEIGHTS_FILE)
        if self.save_optimizer:
            self.engine.save_checkpoint(str(folder), tag=DS_TAG)
        write_state(folder, self.version, extra)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore the engine (weights, optimizer, ZeRO partitions), version and RNG states; a folder saved
        without optimizer state restores the weights only."""
        path = Path(path)
        if not (path / DS_TAG).is_dir():
            self._load_weights_only(path)
            return self._read_state(path)
        loaded, _ = self.engine.load_checkpoint(str(path), tag=DS_TAG, load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {path / DS_TAG}")
        return self._read_state(path)

    def _load_weights_only(self, path: Path) -> None:
        """Weights into the module (gathered under ZeRO-3), then the optimizer's fp32 copies refreshed."""
        import deepspeed

        params = list(self.policy.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=self.zero_stage == 3):
            load_weights(self.policy, path / WEIGHTS_FILE)
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()
        fresh_optimizer_warning(path)

    def close(self) -> None:
        """Destroy the process group this trainer created and remove the environment it set."""
        if self._owns_group and torch.distributed.is_initialized():
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached groups
        self._owns_group = False
        for key in self._owned_env:
            os.environ.pop(key, None)
        self._owned_env = []


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


def prepare_environment() -> list[str]:
    """Set the single-process launcher variables a launcher did not set; return the keys set here."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir() / "torch_extensions"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(
            f"trainer=deepspeed runs one process; WORLD_SIZE={world} needs data-parallel "
            "sharding of the global batch, which is not implemented yet"
        )
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    owned = [key for key in (*defaults, "MASTER_PORT") if key not in os.environ]
    for key in owned:
        os.environ[key] = defaults[key] if key in defaults else str(free_port())
    return owned


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_process_group(deepspeed: Any) -> bool:
    """Initialize torch.distributed through DeepSpeed (gloo without CUDA); True when this call created it."""
    if torch.distributed.is_initialized():
        return False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return True
