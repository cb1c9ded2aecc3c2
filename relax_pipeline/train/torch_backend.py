"""`trainer=torch`: single-process GRPO-family training of a Hugging Face causal LM on recorded samples.

`TorchTrainer` implements the `Trainer` protocol (train/base.py). It takes the `trainer` node as one record
(`TrainerSettings`, train/settings.py: device, the nested `loss`, `batching` and `optim` records, precision) and
`TrainerRun`: what the run agreed on with the engine (the sampling `temperature`) and the credit stage
(`AdvantageSettings`: estimator, KL shaping, whitening). Each record checks its own keys, so a mistake fails
before any model is loaded. Construction seeds torch, loads the policy in float32 on `device`, builds AdamW
and, only when a KL term needs one, a frozen reference copy.

Contract: `train(samples)` runs one optimizer step per global batch (`step.optimizer_step`) and returns
metrics averaged over those steps (`train/...`, `perf/train_time`, `perf/tokens_per_s`); each call that
trains bumps `version`, the weight version the engine serves next. `engine_weights()` is a detached
CPU state dict (tied weights stay tied). `save`/`load` write and read a checkpoint folder atomically
(a temporary sibling folder renamed into place). Every checkpoint folder is a Hugging Face model folder:
`model.safetensors` (each tied tensor stored once, so tied weights stay tied on load) beside the model
path's own config, generation config, tokenizer, chat template and processor files (`copy_model_files`),
so `AutoModelForCausalLM.from_pretrained(folder)`, `AutoTokenizer.from_pretrained(folder)` and
`model.path=folder` all load it. Beside them: the optimizer state (`optimizer.pt`, unless
`save_optimizer=false`), the version, python and torch RNG states and the caller's `extra`
(`trainer_state.pt`), so a resumed run equals an uninterrupted one exactly on CPU. A checkpoint without
optimizer state resumes with a fresh optimizer and says so. The model runs in eval mode (dropout off) so
its logprobs match the engine's.

Under `trainer.lora` (its `rank` set; train/lora.py) the policy is a PEFT model: the base weights frozen in
`trainer.lora.base_dtype`, the float32 adapter the only parameters with gradients and AdamW state. A checkpoint
then holds the adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`) instead of
`model.safetensors`, beside the same model files and state; `engine_adapter()` is what the weight sync sends
(`Engine.update_adapter`), and `engine_weights()` the base's weights with the adapter merged in.

What it does not do: learning-rate schedules, mixed precision, or more than one process
(`trainer=deepspeed` does ZeRO). It does not decide when to checkpoint or how many to keep:
`trainer.save_interval`, `keep_checkpoints`, `resume` and `checkpoint_dir` are the loop's.
"""

from __future__ import annotations

import copy
import logging
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from relax_pipeline.engine.base import AdapterWeights
from relax_pipeline.forest.sample import Sample
from relax_pipeline.models.attention import check_implementation
from relax_pipeline.models.folder import WEIGHTS_FILE, copy_model_files, save_weights
from relax_pipeline.train.allocator import TrainingThread, keep_freed_cpu_memory, wants_freed_memory_kept
from relax_pipeline.train.batching import global_batches
from relax_pipeline.train.lean_layers import lean_activations
from relax_pipeline.train.lora import adapter_weights, load_adapter, merged_state, save_adapter, trainable, wrap
from relax_pipeline.train.optim import adamw, clip_and_step
from relax_pipeline.train.provenance import MicroBatchTime, version_lag
from relax_pipeline.train.settings import TrainerRun, TrainerSettings
from relax_pipeline.train.step import Frozen, StepSettings, mean_metrics, optimizer_step

log = logging.getLogger(__name__)
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"


class TorchTrainer:
    """The policy, its optimizer and the step loop in one process; the torch half of the `trainer` group."""

    num_ranks = 1
    """Data-parallel training processes (`trainer.num_ranks` under trainer=deepspeed; one here)."""
    one_thread = True
    """Whether the work may run on the trainer's own `TrainingThread` (DeepSpeed's collectives stay on the caller's)."""

    def __init__(self, settings: TrainerSettings, run: TrainerRun) -> None:
        self.trainer_settings = settings
        """The `trainer` node this trainer was built from (worker ranks get the same)."""
        self.run_settings = run
        """What the run agreed on: model path, seed, temperature, advantage settings, output folder, Ray."""
        self.settings = StepSettings(settings.loss, settings.batching, run.advantages, run.temperature,
                                     settings.autocast)
        self.optim = settings.optim
        self.model_path, self.seed = run.model_path, run.seed
        self.save_optimizer = settings.save_optimizer
        """`trainer.save_optimizer`: False writes weights only (resuming then starts a fresh optimizer)."""
        self.version = 0
        self.timeline: list[list[MicroBatchTime]] = []
        """The last `train` call's micro-batches on this rank, one list per optimizer step (the session traces)."""
        check_implementation("trainer.attn_implementation", settings.attn_implementation)
        self.attn_implementation = settings.attn_implementation
        """`trainer.attn_implementation`: the policy's attention kernel (None: transformers' default)."""
        kept = wants_freed_memory_kept(settings.keep_freed_memory, settings.device)
        if kept:
            keep_freed_cpu_memory()
        self.thread = TrainingThread(kept and self.one_thread)
        """Where `train`, `load` and `engine_weights` run: one thread of the trainer's own while it keeps freed
        memory, so the kept heap is one malloc arena's, reused every step (train/allocator.py)."""
        self._setup(settings.device, needs_reference=self.settings.loss.use_kl_loss or run.advantages.kl_coef > 0)

    def _setup(self, device: str, needs_reference: bool) -> None:
        """Seed, load the policy (and reference) on `device`, build AdamW."""
        policy, self.pad_id = load_policy(self.model_path, self.seed, device, self.attn_implementation,
                                          self.trainer_settings.lean_activations, self.base_dtype)
        self.device = torch.device(device)
        self.reference = frozen_copy(policy) if needs_reference else None
        self.teacher = load_teacher(self.trainer_settings.teacher, policy, self.device)
        self.policy = wrap(policy, self.lora) if self.lora.enabled else policy
        self.optimizer = adamw(trainable(self.policy), self.optim)
        self.model: Any = self.policy

    @property
    def lora(self) -> Any:
        """`trainer.lora` (train/lora.py): an adapter over frozen base weights when its rank is set."""
        return self.trainer_settings.lora

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the policy's weights load in: float32, or under LoRA `trainer.lora.base_dtype`."""
        return self.lora.dtype if self.lora.enabled else torch.float32

    # ---- training -------------------------------------------------------------------------------

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step per global batch; metrics averaged over the steps. No samples: no step, {}."""
        return self.thread.run(self._train, samples)

    def _train(self, samples: Sequence[Sample]) -> dict[str, float]:
        if not samples:
            return {}
        started = time.perf_counter()
        lag = version_lag(samples, self.version)
        steps = self._steps(global_batches(samples, self.settings.batching))
        self.version += 1
        elapsed = time.perf_counter() - started
        metrics = {f"train/{k}": v for k, v in mean_metrics(steps).items()}
        tokens = sum(len(s.tokens) for s in samples)
        return {**metrics, **lag, "perf/train_time": elapsed, "perf/tokens_per_s": tokens / max(elapsed, 1e-9)}

    def _steps(self, batches: list[list[Sample]]) -> list[dict[str, float]]:
        """One `optimizer_step` per global batch; their metrics."""
        frozen = Frozen(self.reference, self.teacher)
        self.timeline = [[] for _ in batches]
        return [optimizer_step(self.model, frozen, self, b, self.settings, self.pad_id, self.device, self.version,
                               self.timeline[i]) for i, b in enumerate(batches)]

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate gradients; the loss is already normalized by the global batch."""
        loss.backward()

    def step(self) -> float:
        """Clip to `trainer.optim.grad_clip`, AdamW step, zero the gradients; the norm before clipping."""
        return clip_and_step(self.policy, self.optimizer, self.optim.grad_clip)

    # ---- weights and checkpoints ----------------------------------------------------------------

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the policy's state dict, ready for `Engine.update_weights` (under LoRA the base's
        weights with the adapter merged in)."""
        return self.thread.run(cpu_state_dict, self._full_state())

    def _full_state(self) -> dict[str, torch.Tensor]:
        return merged_state(self.policy) if self.lora.enabled else self.policy.state_dict()

    def engine_adapter(self) -> AdapterWeights | None:
        """Under LoRA the adapter for `Engine.update_adapter` (the weight sync sends only it); None otherwise."""
        return self.thread.run(adapter_weights, self.policy) if self.lora.enabled else None

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        """Write a checkpoint folder at `path` atomically; `extra` holds plain values (ints, lists, dicts, ...)."""
        atomic_folder(Path(path), self._write_checkpoint, extra)

    def _write_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        copy_model_files(Path(self.model_path), folder)
        if self.lora.enabled:
            save_adapter(self.policy, folder)
        else:
            save_weights(self.engine_weights(), folder / WEIGHTS_FILE)
        if self.save_optimizer:
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        write_state(folder, self.version, extra)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer (when saved), version and RNG states from `path`; returns the saved `extra`."""
        return self.thread.run(self._load, Path(path))

    def _load(self, path: Path) -> dict[str, Any]:
        if self.lora.enabled:
            load_adapter(self.policy, path)
        else:
            load_weights(self.policy, path / WEIGHTS_FILE)
        if (path / OPTIMIZER_FILE).exists():
            self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        else:
            fresh_optimizer_warning(path)
        return self._read_state(path)

    def _read_state(self, path: Path) -> dict[str, Any]:
        self.version, extra = read_state(path)
        return extra

    def close(self) -> None:
        """Stop the training thread (the DeepSpeed backend also destroys its process group)."""
        self.thread.close()


def load_policy(model_path: str, seed: int, device: str, attention: str | None = None,
                lean: bool = False, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, int]:
    """`torch.manual_seed(seed)`, then the model (causal LM or vision-language; float32 unless `dtype` says) in eval
    mode, with the
    `attention` kernel (None: transformers' default) and, with `lean`, the lean norms and MLPs under autocast
    (train/lean_layers.py), and the id used for padding.

    Padding is masked out and never a target, so any valid id works: the model's pad id, else 0.
    """
    from relax_pipeline.models.spec import load_pretrained

    torch.manual_seed(seed)
    model = load_pretrained(model_path, dtype, attention).to(device).eval()
    if lean:
        lean_activations(model)
    pad = getattr(model.config, "pad_token_id", None)
    return model, pad if isinstance(pad, int) else 0


def load_teacher(path: str | None, policy: torch.nn.Module, device: torch.device) -> torch.nn.Module | None:
    """`trainer.teacher`'s model, frozen on `device` (None without one); its vocabulary must be the policy's, since
    it scores the policy's token ids."""
    if path is None:
        return None
    if not (Path(path).expanduser() / "config.json").is_file():
        raise ValueError(f"trainer.teacher={path!r} is not a Hugging Face folder (no config.json)")
    teacher, _ = load_policy(str(Path(path).expanduser()), 0, str(device))
    ours, theirs = policy.get_input_embeddings().num_embeddings, teacher.get_input_embeddings().num_embeddings
    if ours != theirs:
        raise ValueError(f"trainer.teacher={path!r} has a vocabulary of {theirs} tokens, the policy {ours}: the "
                         "teacher must share the policy's tokenizer")
    return frozen_copy(teacher)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (the KL reference): eval mode, no gradients."""
    reference = copy.deepcopy(model).eval()
    for param in reference.parameters():
        param.requires_grad_(False)
    return reference


def cpu_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies; names that alias one tensor (tied embeddings) share one copy."""
    copies: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out


def fresh_optimizer_warning(path: Path) -> None:
    """Say that a checkpoint without optimizer state resumes with a fresh optimizer."""
    log.warning("checkpoint %s holds no optimizer state (saved with trainer.save_optimizer=false): the weights, "
                "step and data position are restored, the optimizer starts fresh", path)


def load_weights(model: torch.nn.Module, file: Path) -> None:
    """Load `save_weights` output into `model`; only tied aliases may be missing from the file."""
    loaded = load_file(str(file))
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    state = model.state_dict()
    stored = {state[name].data_ptr() for name in loaded}
    untied = [name for name in missing if state[name].data_ptr() not in stored]
    if unexpected or untied:
        raise ValueError(
            f"checkpoint {file} does not match the model: missing {untied[:5]}, unexpected {list(unexpected)[:5]}"
        )


def write_state(folder: Path, version: int, extra: dict[str, Any]) -> None:
    """Version, RNG states (python, torch, cuda when present) and the caller's `extra`."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"version": version, "rng": rng, "extra": extra}, folder / STATE_FILE)


def read_state(folder: Path) -> tuple[int, dict[str, Any]]:
    """Restore the RNG states; return the version and the caller's `extra`."""
    state = torch.load(folder / STATE_FILE, weights_only=True)
    rng = state["rng"]
    random.setstate(_as_tuple(rng["python"]))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["version"]), state["extra"]


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list | tuple) else value


TORCH_WRITE_FAILURES = ("inline_container.cc", "PytorchStreamWriter")
"""Where torch.save's RuntimeError for a failed file write comes from (a full disk reads "unexpected pos")."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint folder could not be written; its partial copy is removed and the previous one stands."""

    def __init__(self, path: Path, error: BaseException) -> None:
        free_gb = shutil.disk_usage(_existing(path)).free / 2**30
        super().__init__(
            f"checkpoint {path} could not be written ({type(error).__name__}: {error}); {free_gb:.1f} GB free on "
            "its disk. The earlier checkpoints are intact. If the disk is full: free space there, keep fewer "
            "checkpoints (trainer.keep_checkpoints=2), save less often (trainer.save_interval) or without the "
            "optimizer state (trainer.save_optimizer=false), or write them elsewhere (trainer.checkpoint_dir)")


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (what `disk_usage` can measure)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def atomic_folder(path: Path, write: Callable[..., None], *args: Any) -> None:
    """Call `write(tmp, *args)` on a temporary sibling folder, then rename it to `path` (replacing it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    old = path.with_name(f".{path.name}.old")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp, *args)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, OSError) or any(mark in str(error) for mark in TORCH_WRITE_FAILURES):
            raise CheckpointWriteError(path, error) from error
        raise  # not the disk (a rank that failed, a bad state): the caller's own error
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
