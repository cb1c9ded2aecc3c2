"""`trainer=torch`: single-process GRPO-family training of a Hugging Face causal LM on recorded samples.

`TorchTrainer` is built by `hydra.utils.instantiate(cfg.trainer, model_path=..., seed=..., temperature=...,
estimator=..., kl_coef=..., normalize_advantages=...)`: its keyword arguments are the `TrainerConfig`
fields plus the run-level values the trainer must agree on with the engine (sampling temperature) and
the credit stage (estimator, KL shaping, whitening). Construction seeds torch, loads the policy in
float32 on `device`, builds AdamW and, only when a KL term needs one, a frozen reference copy.

Contract: `train(samples)` runs one optimizer step per global batch (`step.optimizer_step`) and returns
metrics averaged over those steps (`train/...`, `perf/train_time`, `perf/tokens_per_s`); each call that
trains bumps `version`, the weight version the engine serves next. `engine_weights()` is a detached
CPU state dict (tied weights stay tied). `save`/`load` write and read a checkpoint folder atomically
(a temporary sibling folder renamed into place): `model.safetensors`, the optimizer state, the version,
python and torch RNG states and the caller's `extra`, so a resumed run equals an uninterrupted one
exactly on CPU. The model runs in eval mode (dropout off) so its logprobs match the engine's.

What it does not do: save a Hugging Face folder with tokenizer (the model path has it), learning-rate
schedules, mixed precision, or more than one process (`trainer=deepspeed` does ZeRO).
`save_interval`, `resume` and `checkpoint_dir` are kept as attributes for the caller (run.py).
"""

from __future__ import annotations

import copy
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from relax_pipeline.credit.advantage import check_estimator, token_advantages
from relax_pipeline.train.batching import TrainSample, global_batches
from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.step import StepSettings, mean_metrics, optimizer_step

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"


class TorchTrainer:
    """The policy, its optimizer and the step loop in one process; the torch half of the `trainer` group."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        global_batch_size: int | None = None,
        micro_batch_size: int = 8,
        use_dynamic_batch_size: bool = False,
        max_tokens_per_gpu: int = 8192,
        eps_clip_low: float = 0.2,
        eps_clip_high: float = 0.28,
        use_rollout_logprobs: bool = True,
        tis_cap: float | None = None,
        opsm_delta: float | None = None,
        entropy_coef: float = 0.0,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "k3",
        loss_reduction: str = "token_mean",
        zero_stage: int = 0,
        save_interval: int | None = None,
        resume: bool = False,
        checkpoint_dir: str | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        estimator: str = "grpo",
        kl_coef: float = 0.0,
        normalize_advantages: bool = False,
    ) -> None:
        loss = LossSettings(
            eps_clip_low=eps_clip_low,
            eps_clip_high=eps_clip_high,
            tis_cap=tis_cap,
            opsm_delta=opsm_delta,
            entropy_coef=entropy_coef,
            use_kl_loss=use_kl_loss,
            kl_loss_coef=kl_loss_coef,
            kl_loss_type=kl_loss_type,
            loss_reduction=loss_reduction,
        )
        self.settings = StepSettings(
            loss=loss,
            temperature=temperature,
            estimator=estimator,
            kl_coef=kl_coef,
            normalize_advantages=normalize_advantages,
            use_rollout_logprobs=use_rollout_logprobs,
            micro_batch_size=micro_batch_size,
            use_dynamic_batch_size=use_dynamic_batch_size,
            max_tokens_per_gpu=max_tokens_per_gpu,
        )
        _check(self.settings, grad_clip, global_batch_size)
        self.check_zero_stage(zero_stage)
        self.model_path, self.seed, self.lr, self.weight_decay = model_path, seed, lr, weight_decay
        self.grad_clip, self.global_batch_size, self.zero_stage = grad_clip, global_batch_size, zero_stage
        self.save_interval, self.resume, self.checkpoint_dir = save_interval, resume, checkpoint_dir
        self.version = 0
        self._setup(device, needs_reference=use_kl_loss or kl_coef > 0)

    def check_zero_stage(self, zero_stage: int) -> None:
        """The torch backend has no ZeRO: any stage but 0 is a config mistake."""
        if zero_stage != 0:
            raise ValueError(f"trainer.zero_stage={zero_stage} needs trainer=deepspeed; the torch trainer uses 0")

    def _setup(self, device: str, needs_reference: bool) -> None:
        """Seed, load the policy (and reference) on `device`, build AdamW."""
        self.policy, self.pad_id = load_policy(self.model_path, self.seed, device)
        self.device = torch.device(device)
        self.reference = frozen_copy(self.policy) if needs_reference else None
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        self.model: Any = self.policy

    # ---- training -------------------------------------------------------------------------------

    def train(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step per global batch; metrics averaged over the steps. No samples: no step, {}."""
        if not samples:
            return {}
        started = time.perf_counter()
        steps = [
            optimizer_step(self.model, self.reference, self, batch, self.settings, self.pad_id, self.device)
            for batch in global_batches(samples, self.global_batch_size)
        ]
        self.version += 1
        elapsed = time.perf_counter() - started
        metrics = {f"train/{k}": v for k, v in mean_metrics(steps).items()}
        tokens = sum(len(s.tokens) for s in samples)
        return {**metrics, "perf/train_time": elapsed, "perf/tokens_per_s": tokens / max(elapsed, 1e-9)}

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate gradients; the loss is already normalized by the global batch."""
        loss.backward()

    def step(self) -> float:
        """Clip to `grad_clip` (0: no clipping, norm still measured), AdamW step, zero the gradients."""
        params = [p for p in self.policy.parameters() if p.grad is not None]
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- weights and checkpoints ----------------------------------------------------------------

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the policy's state dict, ready for `Engine.update_weights`."""
        return cpu_state_dict(self.policy.state_dict())

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        """Write a checkpoint folder at `path` atomically; `extra` holds plain values (ints, lists, dicts, ...)."""
        atomic_folder(Path(path), self._write_checkpoint, extra)

    def _write_checkpoint(self, folder: Path, extra: dict[str, Any]) -> None:
        save_weights(self.engine_weights(), folder / WEIGHTS_FILE)
        torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
        write_state(folder, self.version, extra)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore model, optimizer, version and RNG states from `path`; returns the saved `extra`."""
        path = Path(path)
        load_weights(self.policy, path / WEIGHTS_FILE)
        self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        return self._read_state(path)

    def _read_state(self, path: Path) -> dict[str, Any]:
        self.version, extra = read_state(path)
        return extra

    def close(self) -> None:
        """Nothing to release in a single process (the DeepSpeed backend destroys its process group)."""


def _check(settings: StepSettings, grad_clip: float, global_batch_size: int | None) -> None:
    """Config errors at construction, each naming its key; the credit checks are advantage.py's own."""
    check_estimator(settings.estimator)
    probe = torch.zeros(1, 1)
    token_advantages(torch.zeros(1), probe, settings.estimator, kl=probe, kl_coef=settings.kl_coef)
    if settings.temperature < 0:
        raise ValueError(f"rollout.temperature={settings.temperature} must be >= 0 (0 is greedy)")
    if grad_clip < 0:
        raise ValueError(f"trainer.grad_clip={grad_clip}; use 0 (off) or a positive number")
    if global_batch_size is not None and global_batch_size <= 0:
        raise ValueError(f"trainer.global_batch_size={global_batch_size}; use null or a positive number")


def load_policy(model_path: str, seed: int, device: str) -> tuple[torch.nn.Module, int]:
    """`torch.manual_seed(seed)`, then the float32 model (causal LM or vision-language) in eval mode and the
    id used for padding.

    Padding is masked out and never a target, so any valid id works: the model's pad id, else 0.
    """
    from relax_pipeline.models.spec import load_pretrained

    torch.manual_seed(seed)
    model = load_pretrained(model_path, torch.float32).to(device).eval()
    pad = getattr(model.config, "pad_token_id", None)
    return model, pad if isinstance(pad, int) else 0


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


def save_weights(weights: dict[str, torch.Tensor], file: Path) -> None:
    """safetensors file of `weights`, each shared tensor stored once under its first name."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in weights.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor.contiguous()
    save_file(unique, str(file))


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


def atomic_folder(path: Path, write: Callable[..., None], *args: Any) -> None:
    """Call `write(tmp, *args)` on a temporary sibling folder, then rename it to `path` (replacing it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    old = path.with_name(f".{path.name}.old")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp, *args)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)
