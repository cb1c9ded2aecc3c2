"""GPU check of the embedded engine and the torch trainer on CUDA with the tiny model (built here, no download); run
by `scripts/gpu_check.sh`. Each check can fail:

1. engine: `HFEngine(device=cuda)` generates greedy tokens whose logprobs are finite and agree with the same
   engine on the CPU for the first token (within 1e-3: kernels differ), and a batch of 16 sampled requests all
   finish;
2. trainer: `TorchTrainer(device=cuda)` trains one step on random samples: finite loss, a positive gradient norm,
   weights moved, the version advanced.

    python scripts/gpu_check_cuda.py [CACHE_DIR]

Prints one line per check and exits non-zero when one fails.
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from relax_pipeline.engine.base import SamplingParams  # noqa: E402
from relax_pipeline.engine.hf.engine import HFEngine  # noqa: E402
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402

PROMPT = list(range(3, 40))


async def _greedy(model: Path, device: str) -> tuple[tuple[int, ...], tuple[float, ...], int]:
    engine = HFEngine(HFEngineSettings(device=device), EngineRun(str(model)))
    await engine.start()
    try:
        one = await engine.generate(PROMPT, SamplingParams(16, temperature=0.0), "greedy")
        batch = await asyncio.gather(*(engine.generate(PROMPT[i:], SamplingParams(12, seed=i), f"b{i}")
                                       for i in range(16)))
        return one.output_ids, one.logprobs, sum(1 for r in batch if r.finish_reason in ("stop", "length"))
    finally:
        await engine.close()


def check_engine(model: Path) -> bool:
    ids, logprobs, finished = asyncio.run(_greedy(model, "cuda"))
    cpu_ids, cpu_logprobs, _ = asyncio.run(_greedy(model, "cpu"))
    ok = (len(ids) == 16 and all(math.isfinite(x) for x in logprobs) and ids[0] == cpu_ids[0]
          and abs(logprobs[0] - cpu_logprobs[0]) < 1e-3 and finished == 16)
    print(f"check 1 engine on cuda: {len(ids)} greedy tokens, first {ids[0]} (cpu {cpu_ids[0]}), logprob "
          f"{logprobs[0]:.6f} (cpu {cpu_logprobs[0]:.6f}), {finished}/16 sampled requests finished: {ok}", flush=True)
    return ok


def check_trainer(model: Path) -> bool:
    from relax_pipeline.train.settings import TrainerRun, TrainerSettings
    from relax_pipeline.train.torch_backend import TorchTrainer
    from tests.integration.test_trainer import make_samples

    trainer = TorchTrainer(TrainerSettings(device="cuda"), TrainerRun(str(model)))
    before = {k: v.detach().cpu().clone() for k, v in trainer.engine_weights().items()}
    metrics = trainer.train(make_samples(8, seed=1, logprob=-3.0))
    after = trainer.engine_weights()
    moved = any(not torch.equal(before[k], after[k].detach().cpu()) for k in before)
    on_cuda = next(trainer.policy.parameters()).device.type == "cuda"
    ok = (on_cuda and math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0 and moved
          and trainer.version == 1)
    print(f"check 2 trainer on cuda: loss {metrics['train/loss']:.6f}, grad norm {metrics['train/grad_norm']:.6f}, "
          f"weights moved {moved}, version {trainer.version}, policy on cuda {on_cuda}: {ok}", flush=True)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("GPU CHECK NOT RUN: torch has no CUDA")
        return 2
    model = build_tiny(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="gpu-check-tiny-"))
    ok = check_engine(model)
    ok &= check_trainer(model)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
