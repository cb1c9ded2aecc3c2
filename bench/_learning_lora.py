"""`bench/learning.py --lora`: a preset and its LoRA preset (`<experiment>_lora`) side by side, one process each.

Each run is `bench/learning.py` itself in a child process (so each peak resident memory is its own whole run's:
engine, gateway and trainer), which prints its own step table and writes a summary (`--summary FILE`): its mean
step, training step, weight sync and rollout (steps after the first), its peak resident memory, the size of its
last checkpoint (full weights and AdamW state, or the PEFT adapter folder and its AdamW state), the machine's
load average before and after, and with `--eval` its eval curve. This module then prints the two side by side
with their ratios, and with `--eval` each run's held-out success at the other's eval times (the latest eval of the
other run at or before that minute: the same wall time).

A helper of bench/learning.py, not a bench (its name starts with `_`).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = (("mean step s", "step"), ("train step s", "train"), ("weight sync s", "sync"), ("rollout s", "rollout"),
        ("checkpoint MB", "checkpoint_mb"), ("peak RSS GB", "peak_gb"))
"""The side-by-side rows: label, summary key."""


def summary(folder: Path, steps: list[dict], evals: list[tuple[int, float, dict]], load: tuple[float, ...]) -> dict:
    """What a child run reports to the comparison (see the module)."""
    measured = steps[1:] or steps
    mean = {key: sum(s.get(metric, 0.0) for s in measured) / len(measured)
            for key, metric in (("step", "perf/step_time"), ("train", "perf/train_time"),
                                ("sync", "perf/weight_sync_s"), ("rollout", "perf/rollout_time"))}
    return {**mean, "checkpoint_mb": checkpoint_mb(folder), "steps": len(steps),
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "load": [*load, *os.getloadavg()], "evals": [[s, m, success(x)] for s, m, x in evals]}


def checkpoint_mb(folder: Path) -> float:
    """Size of the run's last checkpoint folder (MB), 0 without one."""
    saved = sorted((folder / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file()) / 2**20 if saved else 0.0


def success(metrics: dict[str, float]) -> dict[str, float]:
    """Each eval dataset's success (`eval/<name>/raw_reward`)."""
    return {key.split("/")[1]: value for key, value in metrics.items()
            if key.startswith("eval/") and key.endswith("/raw_reward")}


def compare(script: Path, experiment: str, flags: list[str], overrides: list[str]) -> None:
    """Run `experiment` and `<experiment>_lora` one after the other, each in its own process; print both."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="relax-lora-bench-") as tmp:
        for label, preset in (("full", experiment), ("LoRA", f"{experiment}_lora")):
            out = Path(tmp) / f"{label}.json"
            print(f"==== {label}: experiment={preset} (load average {os.getloadavg()[0]:.1f})", flush=True)
            command = [sys.executable, str(script), "--experiment", preset, "--summary", str(out), *flags, *overrides]
            subprocess.run(command, check=True)
            results[label] = json.loads(out.read_text())
    report(results)


def report(results: dict[str, dict]) -> None:
    full, lora = results["full"], results["LoRA"]
    print(f"\n{'':<16}{'full':>10}{'LoRA':>10}{'full/LoRA':>11}")
    for label, key in ROWS:
        ratio = full[key] / lora[key] if lora[key] else float("nan")
        print(f"{label:<16}{full[key]:>10.2f}{lora[key]:>10.2f}{ratio:>10.2f}x")
    for label, run in results.items():
        print(f"load average (1, 5, 15 min) {label}: before {fmt(run['load'][:3])}, after {fmt(run['load'][3:])}")
    print(f"LoRA / full: training step {full['train'] / lora['train']:.2f}x faster, weight sync "
          f"{full['sync'] / max(lora['sync'], 1e-9):.1f}x faster, checkpoint {full['checkpoint_mb']:.0f} MB -> "
          f"{lora['checkpoint_mb']:.1f} MB, peak {full['peak_gb']:.2f} GB -> {lora['peak_gb']:.2f} GB")
    if full["evals"] and lora["evals"]:
        report_curves(full["evals"], lora["evals"])


def report_curves(full: list, lora: list) -> None:
    """Each eval of either run beside the other run's latest eval at or before the same minute."""
    print("held-out success at the same wall time (minutes from each run's start):")
    for label, mine, other in (("LoRA", lora, full), ("full", full, lora)):
        for step, minutes, scores in mine:
            theirs = [s for _, m, s in other if m <= minutes]
            cells = "  ".join(f"{name} {value:.3f} vs {theirs[-1].get(name, float('nan')):.3f}" if theirs else
                              f"{name} {value:.3f} vs -" for name, value in scores.items())
            print(f"  {label} after {step} steps, {minutes:.1f} min: {cells}")


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.1f}" for v in values)
