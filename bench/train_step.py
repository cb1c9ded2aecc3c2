"""Training throughput: `TorchTrainer.train` against a bare Hugging Face step on the same padded batch
(`--case step`), and tree training against the per-row path on forked sessions (`--case tree`).

Work: 16 synthetic samples of about 300 tokens, half prompt and half response, on the tiny model, packed
by the trainer's dynamic batching into one micro-batch (the same right-padded [16, L] batch the baseline
gets). Ours is the whole `train` call: collate, the policy loss with PPO clipping and the entropy metric,
clipping, AdamW. The baseline is the least a trainer can do: forward, plain cross-entropy on the response
tokens, backward, AdamW step. The two alternate rep by rep so machine load hits both alike; the medians
are printed as tokens/s with their ratio (target >= 0.8).

`--case tree`: forked multi-turn sessions as a harness that rewrites its history exports them (smolagents; chat
harnesses that drop reasoning): every turn forks, because the history the next turn sends holds a rewritten copy
of the generated turn, so a session of `--turns` turns exports one row per turn, each the whole history so far plus
that turn's generated tokens. `--sessions` such sessions share a system prompt (one GRPO group). The same samples
train through two `TorchTrainer`s that differ only in `trainer.batching.tree` (both with dynamic batching at
`--budget` tokens), alternating rep by rep; printed: the tokens each computes (the per-row path's padded rows,
less its shared prompt; the tree's nodes), the median step times and their ratio, `tree speed-up N.NNx` (target
>= 3x). The model is SmolLM2-135M-Instruct (`model=smollm2`, built locally), or `--model tiny`.

`--case lean`: the lean activations (`trainer.lean_activations`, train/lean_layers.py, and the grouped kernel's bf16
probabilities) on and off, on the step `experiment=smollm2_arith` trains: `--groups` GRPO groups of 8 rows sharing
a prompt of 48 tokens, 16 response tokens each, bf16 autocast, grouped attention, one micro-batch. Two
`TorchTrainer`s alternate rep by rep; printed: the bytes each step keeps for the backward (every tensor autograd
saves, counted once per storage, weights' casts included), the median step times and their ratio.

`--case lora`: that step as `experiment=smollm2_arith` trains it (bf16 autocast over float32 weights, AdamW over
every weight) against `experiment=smollm2_arith_lora` (trainer.lora: the base frozen in bf16, a rank-`--lora-rank`
adapter on every linear layer, AdamW over the adapter alone), alternating rep by rep; printed: the median step
times and their ratio, `LoRA speed-up N.NNx` (target >= 1.5x), what each hands the engine after a step (bytes and
the trainer's seconds) and the size of the checkpoint each writes.

    python bench/train_step.py [--reps 10] [--samples 16] [--length 300] [--smoke]
    python bench/train_step.py --case tree [--sessions 2] [--turns 8] [--reps 2] [--model smollm2|tiny] [--smoke]
    python bench/train_step.py --case lean [--groups 8] [--reps 6] [--model smollm2|tiny] [--smoke]
    python bench/train_step.py --case lora [--groups 8] [--reps 6] [--lora-rank 16] [--model smollm2|tiny] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from _smoke import parse_args  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from relax_pipeline.forest.sample import Sample  # noqa: E402
from relax_pipeline.models.tiny import build_tiny  # noqa: E402
from relax_pipeline.train.batching import BatchSettings, micro_batches  # noqa: E402
from relax_pipeline.train.lora import LoraSettings  # noqa: E402
from relax_pipeline.train.settings import TrainerRun, TrainerSettings  # noqa: E402
from relax_pipeline.train.step import collate  # noqa: E402
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
    parser.add_argument("--case", choices=("step", "tree", "lean", "lora"), default="step")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (default: 10 for step, 2 for tree)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=300)
    parser.add_argument("--sessions", type=int, default=2, help="--case tree: forked sessions sharing a prompt")
    parser.add_argument("--turns", type=int, default=8, help="--case tree: turns per session (a fork at each)")
    parser.add_argument("--budget", type=int, default=4096, help="--case tree: trainer.batching.max_tokens_per_gpu")
    parser.add_argument("--groups", type=int, default=8, help="--case lean: GRPO groups of 8 rows")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="--case tree's and lean's model")
    parser.add_argument("--device", default="cpu", help="trainer.device (and the bare step's), e.g. cuda")
    parser.add_argument("--lora-rank", type=int, default=16, help="--case lora: trainer.lora.rank")
    args = parse_args(parser, reps=1, samples=2, length=32, turns=3, groups=1, model="tiny")
    if args.case in CASES:
        CASES[args.case](args)
        return
    path = build_tiny(seed=0)
    samples = synthetic_samples(args.samples, args.length)
    packing = BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=1 << 20)
    trainer = TorchTrainer(TrainerSettings(device=args.device, batching=packing), TrainerRun(str(path)))
    bare = BareStep(path, samples, args.device)
    ours_times, bare_times = [], []
    for rep in range((args.reps or 10) + 2):  # two warm-up reps each
        ours, base = timed(lambda: trainer.train(samples)), timed(bare)
        if rep >= 2:
            ours_times.append(ours)
            bare_times.append(base)
    report(sum(len(s.tokens) for s in samples), ours_times, bare_times)


# ---- --case tree -------------------------------------------------------------------------------------------

SYSTEM, TASK, GENERATED, REWRITTEN, OBSERVATION = 48, 8, 24, 12, 36
"""Tokens of the shared system prompt, each session's task, a generated turn, its rewritten copy in the history
(reasoning dropped), and a tool observation."""


def forked_sessions(sessions: int, turns: int, seed: int = 0) -> list[Sample]:
    """`sessions` sessions of `turns` turns, a fork at every turn: row k = history before turn k + turn k."""
    rng = random.Random(seed)
    system = _ids(rng, SYSTEM)
    rows = []
    for _ in range(sessions):
        history = system + _ids(rng, TASK)
        for _ in range(turns):
            generated = _ids(rng, GENERATED)
            logprobs = tuple(-rng.uniform(0.5, 4.0) for _ in generated)
            rows.append(Sample(history + generated, len(history), (1,) * GENERATED, logprobs,
                               advantage=rng.uniform(-1.0, 1.0)))
            history = history + _ids(rng, REWRITTEN) + _ids(rng, OBSERVATION)
    return rows


def _ids(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(10, 1000) for _ in range(count))


def computed_tokens(samples: list[Sample], batching: BatchSettings) -> int:
    """Tokens the forward computes: per micro-batch the tree's nodes, or the padded rows less the shared prefix."""
    total = 0
    for batch in micro_batches(samples, batching):
        packed = collate(batch, 0, "cpu", "auto" if batching.tree else "off")
        if packed.tree is not None:
            total += packed.tree.computed
        else:
            total += packed.input_ids.numel() - (len(batch) - len(packed.prefix_rows)) * packed.shared
    return total


def tree_model(name: str) -> tuple[Path, str]:
    """SmolLM2-135M-Instruct's folder (or the tiny model: asked for, or SmolLM2 unavailable) and a line naming it."""
    if name == "smollm2":
        try:
            from relax_pipeline.models.smollm2 import build_smollm2

            return build_smollm2(), "SmolLM2-135M-Instruct (model=smollm2)"
        except Exception as error:  # noqa: BLE001 - any failure falls back to the tiny model, said out loud
            return build_tiny(seed=0), f"the tiny test model (smollm2 unavailable: {type(error).__name__}: {error})"
    return build_tiny(seed=0), "the tiny test model (--model tiny)"


def alternate(trainers: dict[bool, TorchTrainer], samples: list[Sample], reps: int) -> dict[bool, list[float]]:
    """Each trainer's `train(samples)` times, alternating rep by rep after one warm-up rep each."""
    times: dict[bool, list[float]] = {key: [] for key in trainers}
    for rep in range(reps + 1):
        for key, trainer in trainers.items():
            elapsed = timed(lambda t=trainer: t.train(samples))
            if rep >= 1:
                times[key].append(elapsed)
    return times


def tree_case(args: argparse.Namespace) -> None:
    path, named = tree_model(args.model)
    samples = forked_sessions(args.sessions, args.turns)
    batchings = {tree: BatchSettings(use_dynamic_batch_size=True, max_tokens_per_gpu=args.budget, tree=tree)
                 for tree in (False, True)}
    trainers = {tree: TorchTrainer(TrainerSettings(device=args.device, batching=b), TrainerRun(str(path)))
                for tree, b in batchings.items()}
    times = alternate(trainers, samples, args.reps or 2)
    print(f"model: {named}, torch threads {torch.get_num_threads()}, float32")
    print(f"workload: {args.sessions} sessions x {args.turns} turns, a fork at every turn: {len(samples)} rows, "
          f"{sum(len(s.tokens) for s in samples)} row tokens")
    rows, tree = (computed_tokens(samples, batchings[t]) for t in (False, True))
    print(f"tokens computed   per-row {rows:8d}   tree {tree:8d}   ratio {rows / tree:.2f}x")
    slow, fast = statistics.median(times[False]), statistics.median(times[True])
    print(f"step time         per-row {slow:8.2f} s tree {fast:8.2f} s (median of {len(times[True])})")
    print(f"tree speed-up {slow / fast:.2f}x  (target >= 3x)")


# ---- --case lean -------------------------------------------------------------------------------------------


def arith_groups(groups: int, seed: int = 0) -> list[Sample]:
    """`groups` GRPO groups of 8 rows: a shared 48-token prompt and 16 response tokens each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(groups):
        prompt = _ids(rng, 48)
        for _ in range(8):
            logprobs = tuple(-rng.uniform(0.1, 3.0) for _ in range(16))
            rows.append(Sample(prompt + _ids(rng, 16), 48, (1,) * 16, logprobs, advantage=rng.uniform(-1.0, 1.0)))
    return rows


def kept_bytes(trainer: TorchTrainer, samples: list[Sample]) -> int:
    """Bytes one `train` call keeps for the backward: every tensor autograd saves, once per storage."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def train() -> None:  # on the trainer's own thread: saved-tensor hooks are per thread
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer._train(samples)

    trainer.thread.run(train)
    return sum(kept.values())


def lean_case(args: argparse.Namespace) -> None:
    path, named = tree_model(args.model)
    samples = arith_groups(args.groups)
    batching = BatchSettings(micro_batch_size=len(samples))
    trainers = {lean: TorchTrainer(TrainerSettings(device=args.device, batching=batching, autocast="bfloat16",
                                                   attn_implementation="grouped", lean_activations=lean),
                                   TrainerRun(str(path))) for lean in (False, True)}
    times = alternate(trainers, samples, args.reps or 6)
    kept = {lean: kept_bytes(trainer, samples) for lean, trainer in trainers.items()}
    print(f"model: {named}, torch threads {torch.get_num_threads()}, bf16 autocast, grouped attention")
    print(f"workload: {args.groups} groups x 8 rows (48 prompt + 16 response tokens), one micro-batch")
    print(f"kept for the backward   transformers' {kept[False] / 2**20:8.1f} MiB   "
          f"lean {kept[True] / 2**20:8.1f} MiB   lean / transformers' {kept[True] / kept[False]:.2f}")
    slow, fast = statistics.median(times[False]), statistics.median(times[True])
    print(f"step time               transformers' {slow:8.2f} s     lean {fast:8.2f} s     "
          f"lean / transformers' {fast / slow:.2f} (median of {len(times[True])})")


# ---- --case lora -------------------------------------------------------------------------------------------


def lora_case(args: argparse.Namespace) -> None:
    """`experiment=smollm2_arith`'s step (bf16 autocast over float32 weights, AdamW over every weight) against
    `smollm2_arith_lora`'s (bf16 autocast, bf16 base frozen, a rank-16 adapter on every linear layer, AdamW over the
    adapter)."""
    path, named = tree_model(args.model)
    samples = arith_groups(args.groups)
    batching = BatchSettings(micro_batch_size=len(samples))
    common = {"device": args.device, "batching": batching, "attn_implementation": "grouped"}
    lora = LoraSettings(rank=args.lora_rank, alpha=32, base_dtype="bfloat16")
    trainers = {False: TorchTrainer(TrainerSettings(autocast="bfloat16", **common), TrainerRun(str(path))),
                True: TorchTrainer(TrainerSettings(autocast="bfloat16", lora=lora, **common), TrainerRun(str(path)))}
    times = alternate(trainers, samples, args.reps or 6)
    print(f"model: {named}, torch threads {torch.get_num_threads()}, grouped attention")
    print(f"workload: {args.groups} groups x 8 rows (48 prompt + 16 response tokens), one micro-batch")
    full, adapter = statistics.median(times[False]), statistics.median(times[True])
    print(f"step time     full (bf16 autocast) {full:8.2f} s   LoRA rank {args.lora_rank} (bf16 base) {adapter:8.2f} s "
          f"(median of {len(times[True])}, alternating)")
    sync = {key: sync_payload(trainer) for key, trainer in trainers.items()}
    print(f"weight sync   full {sync[False][0] / 2**20:8.1f} MiB in {sync[False][1]:.3f} s   adapter "
          f"{sync[True][0] / 2**20:8.1f} MiB in {sync[True][1]:.3f} s (the trainer's side: the tensors handed over)")
    sizes = {key: checkpoint_bytes(trainer) for key, trainer in trainers.items()}
    print(f"checkpoint    full {sizes[False] / 2**20:8.1f} MiB   adapter {sizes[True] / 2**20:8.1f} MiB "
          "(weights or adapter, AdamW state, trainer state, model files)")
    print(f"LoRA speed-up {full / adapter:.2f}x  (target >= 1.5x)")


def sync_payload(trainer: TorchTrainer) -> tuple[int, float]:
    """Bytes and seconds of what the trainer hands the engine after a step: its adapter, else every weight."""
    started = time.perf_counter()
    adapter = trainer.engine_adapter()
    tensors = adapter.tensors if adapter is not None else trainer.engine_weights()
    seconds = time.perf_counter() - started
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors.values()}.values()), seconds


def checkpoint_bytes(trainer: TorchTrainer) -> int:
    """Size of the checkpoint folder `trainer.save` writes."""
    with tempfile.TemporaryDirectory(prefix="relax-bench-ckpt-") as tmp:
        trainer.save(Path(tmp) / "step", {"step": 0})
        return sum(f.stat().st_size for f in (Path(tmp) / "step").rglob("*") if f.is_file())


CASES = {"tree": tree_case, "lean": lean_case, "lora": lora_case}


def report(tokens: int, ours_times: list[float], bare_times: list[float]) -> None:
    ours, bare = tokens / statistics.median(ours_times), tokens / statistics.median(bare_times)
    print(f"batch: {tokens} tokens, torch threads {torch.get_num_threads()}")
    print(f"TorchTrainer.train      {ours:10.0f} tokens/s  (median of {len(ours_times)})")
    print(f"bare HF fwd+bwd+AdamW   {bare:10.0f} tokens/s")
    print(f"ratio ours / bare       {ours / bare:10.2f}  (target >= 0.8)")


if __name__ == "__main__":
    main()
