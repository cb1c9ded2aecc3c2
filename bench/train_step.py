"""Training throughput: `TorchTrainer.train` against a bare Hugging Face step on the same padded batch.

Work: 16 synthetic samples of about 300 tokens, half prompt and half response, on the tiny model, packed
by the trainer's dynamic batching into one micro-batch (the same right-padded [16, L] batch the baseline
gets). Ours is the whole `train` call: collate, the policy loss with PPO clipping and the entropy metric,
clipping, AdamW. The baseline is the least a trainer can do: forward, plain cross-entropy on the response
tokens, backward, AdamW step. The two alternate rep by rep so machine load hits both alike; the medians
are printed as tokens/s with their ratio (target >= 0.8).

    python bench/train_step.py [--reps 10] [--samples 16] [--length 300] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _smoke import parse_args  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from relax_pipeline.forest.sample import Sample  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402
from relax_pipeline.train.batching import BatchSettings  # noqa: E402
from relax_pipeline.train.settings import TrainerRun, TrainerSettings
from relax_pipeline.train.torch_backend import TorchTrainer  # noqa: E402


def synthetic_samples(count: int, length: int, seed: int = 0) -> list[Sample]:
    """`count` samples of length +-10%, the first half prompt; every response token trains."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        total = rng.randint(int(length * 0.9), int(length * 1.1))
        prompt = total // 2
        tokens = tuple(rng.randrange(10, 1000) for _ in range(total))
        response = total - prompt
        samples.append(Sample(tokens, prompt, (1,) * response, (-7.0,) * response, advantage=rng.uniform(-1, 1)))
    return samples


class BareStep:
    """Forward, cross-entropy on the response tokens, backward, AdamW: the baseline's whole step."""

    def __init__(self, model_path: Path, samples: list[Sample], device: str = "cpu") -> None:
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ids, self.attention, self.labels = (t.to(device) for t in _padded(samples))

    def __call__(self) -> float:
        logits = self.model(input_ids=self.ids, attention_mask=self.attention, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), self.labels[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def _padded(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside the response)."""
    length = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, s in enumerate(samples):
        ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        attention[row, : len(s.tokens)] = 1
        labels[row, s.prompt_length : len(s.tokens)] = torch.tensor(s.tokens[s.prompt_length :])
    return ids, attention, labels


def timed(step: object) -> float:
    started = time.perf_counter()
    step()  # type: ignore[operator]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--device", default="cpu", help="trainer.device (and the bare step's), e.g. cuda")
    args = parse_args(parser, reps=1, samples=2, length=32)
    path = build_tiny(seed=0)
    samples = synthetic_samples(args.samples, args.length)
    packing = BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=1 << 20)
    trainer = TorchTrainer(TrainerSettings(device=args.device, batching=packing), TrainerRun(str(path)))
    bare = BareStep(path, samples, args.device)
    ours_times, bare_times = [], []
    for rep in range(args.reps + 2):  # two warm-up reps each
        ours, base = timed(lambda: trainer.train(samples)), timed(bare)
        if rep >= 2:
            ours_times.append(ours)
            bare_times.append(base)
    report(sum(len(s.tokens) for s in samples), ours_times, bare_times)


def report(tokens: int, ours_times: list[float], bare_times: list[float]) -> None:
    ours, bare = tokens / statistics.median(ours_times), tokens / statistics.median(bare_times)
    print(f"batch: {tokens} tokens, torch threads {torch.get_num_threads()}")
    print(f"TorchTrainer.train      {ours:10.0f} tokens/s  (median of {len(ours_times)})")
    print(f"bare HF fwd+bwd+AdamW   {bare:10.0f} tokens/s")
    print(f"ratio ours / bare       {ours / bare:10.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
