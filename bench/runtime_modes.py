"""Runtime modes on one long-tailed workload: samples/s, engine busy fraction, and each mode vs `sync`.

The whole pipeline runs for real (gateway, agent subprocesses from `examples/long_tail_agent`, stages,
strategies, credit, step loop) around a simulated engine and trainer (`testing.engines.PacedEngine`: every
`--token-s` each active request gets a token, lengths log-normal; `testing.engines.PacedTrainer`: a fixed
`--train-s` optimizer step), so what is measured is the scheduler. Workload per session: `--startup-s`
of agent start-up, `--turns` model calls with log-normal tool latency between them. Every mode runs the
same steps, groups and seeds; the first step is left out of the rates (nothing is warm yet).

Printed per mode, over steps 2..N-1 (from the end of step 1 to the end of the step before the last): trained
samples/s, engine busy fraction (time with at least one generation active), mean rollout time per step,
the throughput ratio to `sync`, and the share of the agent slots held by a running agent (`runtime.concurrency`
groups of n sessions, one slot a session; from the dump's `created` and `exited` marks): a mode whose slots are
all busy runs at the ceiling of this concurrency, which only more slots or shorter sessions raise, so its ratio to
`sync` is then set by the workload (how long sync's step waits for its slowest session and its training), not by
the scheduler; then the same figures to the end of the last step. The last step is left
out of the first table because under fully_async it is the run's end, not its steady state: it drains every
resident group and then trains with nothing left to generate, so the engine idles for the whole `--train-s`
(measured: 99.8% busy over steps 2..5 of 6, 93.5% with step 6). Then, on short one-turn sessions whose optimizer
step is longer than the agent start-up (start-up can only hide behind time that exists between steps), the share
of the start-up that `prelaunch` removes from the rollout time: (sync - prelaunch) / (sync - sync without
start-up). Targets: fully_async >= 3x sync and >= 95% busy; prelaunch removes >= 80% of the start-up.

    python bench/runtime_modes.py [--steps 8] [--startup-s 2] [--train-s 1] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _smoke import parse_args  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from relax_pipeline.config import CONF_DIR, quote_placeholders, register  # noqa: E402
from relax_pipeline.run import run  # noqa: E402
from relax_pipeline.testing.engines import PacedEngine, register_paced  # noqa: E402

MODES = ("sync", "prelaunch", "partial", "fully_async")
RESIDENT = 2
"""Resident groups (`runtime.concurrency`) per group of a step (`rollout.batch_size`)."""
_STEP = re.compile(r"^(\S+ \S+) INFO relax_pipeline: step (\d+) metrics (.*)$")


def workload(folder: Path, startup_s: float, turns: int, tool_s: float, max_tokens: int) -> Path:
    meta = {"startup_s": startup_s, "turns": turns, "tool_mean_s": tool_s, "tool_sigma": 1.0, "max_tokens": max_tokens}
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps({"input": f"task {i}", "metadata": meta}) + "\n" for i in range(64)))
    return path


def overrides(folder: Path, data: Path, mode: str, args: argparse.Namespace, train_s: float,
              mean_tokens: float) -> list[str]:
    groups = args.batch
    return [
        "job=train", f"output_dir={folder}", f"dataset.path={data}", "agent=long_tail", f"runtime={mode}",
        "engine=paced", f"engine.token_s={args.token_s}",
        f"engine.mean_tokens={mean_tokens}", "engine.sigma=1.0",
        "trainer=paced", f"trainer.train_s={train_s}",
        f"rollout.num_steps={args.steps}", f"rollout.batch_size={groups}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.over_sampling_batch_size={groups + groups // 2}", f"runtime.concurrency={RESIDENT * groups}",
        "rollout.max_response_len=1024", "rollout.max_context_len=8192", "runtime.max_staleness=null",
        f"debug.save_rollout_data={folder}/rollout_{{rollout_id}}.jsonl",
    ]


def steps_of(log: Path) -> list[tuple[float, dict[str, float]]]:
    """(wall time the step ended, its metrics) for every step in run.log."""
    out = []
    for line in log.read_text().splitlines():
        if m := _STEP.match(line):
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, {k: float(v) for k, v in (kv.split("=") for kv in m.group(3).split())}))
    return out


def measure(mode: str, args: argparse.Namespace, data_args: tuple, train_s: float, mean_tokens: float
            ) -> dict[str, float]:
    """One run; rates over the steady steps (`window`) and, as `run_*`, over steps 2..N (to the last step's end)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = workload(folder, *data_args)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            given = overrides(folder, data, mode, args, train_s, mean_tokens)
            cfg = compose("config", overrides=quote_placeholders(given))
        run(cfg)
        steps = steps_of(folder / "run.log")
        agents = agent_spans(folder)
    engine = PacedEngine.last
    assert engine is not None
    steady, whole = window(steps, engine.busy_spans, len(steps) - 1), window(steps, engine.busy_spans, len(steps))
    return {**steady, "slots": occupancy(steps, agents, len(steps) - 1) / agent_slots(args),
            **{f"run_{key}": value for key, value in whole.items()}}


def agent_slots(args: argparse.Namespace) -> int:
    """The agent slots of every run: `runtime.concurrency` groups (`overrides`) of n sessions, one slot a session."""
    return RESIDENT * args.batch * args.n


def agent_spans(folder: Path) -> list[tuple[float, float]]:
    """(created, exited) epoch seconds of every session in the run's dumps: the time it held its agent slot (a group
    takes its sessions' slots when they are created, prelaunched ones included, and each is given back when its agent
    ends; `running` is no start: a parked session is marked running again when it resumes). A session without an
    `exited` mark (dropped before its agent ended) held its slot to its last mark."""
    spans = []
    for dump in folder.glob("rollout_*.jsonl"):
        for line in dump.read_text().splitlines():
            timing = {key: value for key, value in json.loads(line)["timing"].items()
                      if key != "agent_s" and isinstance(value, float)}
            if "created" in timing:
                spans.append((timing["created"], timing.get("exited", max(timing.values()))))
    return spans


def occupancy(steps: list[tuple[float, dict[str, float]]], spans: list[tuple[float, float]], last: int) -> float:
    """Mean agent slots in use over the window of `window` (the end of step 1 to the end of `steps[last - 1]`)."""
    begin, end = steps[0][0], steps[last - 1][0]
    return sum(max(0.0, min(b, end) - max(a, begin)) for a, b in spans) / (end - begin)


def window(steps: list[tuple[float, dict[str, float]]], spans: list[tuple[float, float]], last: int
           ) -> dict[str, float]:
    """Rates from the end of step 1 (the first is left out: nothing is warm) to the end of `steps[last - 1]`.

    The steady window stops before the last step: under fully_async it drains every resident group and then
    trains with nothing left to generate (the engine idles for the whole `--train-s`, ~7% of a 6-step window),
    a cost paid once per run, which the other modes' last steps do not have; it is printed apart (`run_*`)."""
    begin, end = steps[0][0], steps[last - 1][0]
    busy = sum(max(0.0, min(b, end) - max(a, begin)) for a, b in spans)
    later = [m for _, m in steps[1:last]]
    mixed = [1.0 - m["train/version_lag/0"] for m in later if "train/version_lag/0" in m]
    return {"samples_per_s": sum(m.get("train/samples", 0.0) for m in later) / (end - begin),
            "busy": busy / (end - begin), "rollout_s": sum(m["perf/rollout_time"] for m in later) / len(later),
            "mixed": sum(mixed) / len(mixed) if mixed else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="rollout.batch_size (groups per step)")
    parser.add_argument("--n", type=int, default=4, help="rollout.n_samples_per_prompt")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tool-s", type=float, default=0.3, help="mean tool latency (log-normal, sigma 1)")
    parser.add_argument("--token-s", type=float, default=0.01, help="simulated engine time per decode step")
    parser.add_argument("--mean-tokens", type=float, default=40.0, help="mean generation length (sigma 1)")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--startup-s", type=float, default=2.0)
    parser.add_argument("--train-s", type=float, default=1.0)
    args = parse_args(parser, steps=3, batch=1, n=2, turns=1, tool_s=0.05, token_s=0.002, mean_tokens=4.0,
                      max_tokens=16, startup_s=0.1, train_s=0.1)
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (step 1 warms up, the last is reported apart)")
    register()
    register_paced()
    long_tail = (args.startup_s, args.turns, args.tool_s, args.max_tokens)
    results = {mode: measure(mode, args, long_tail, args.train_s, args.mean_tokens) for mode in MODES}
    base = results["sync"]["samples_per_s"]
    print(f"long-tailed workload: {args.batch} groups x {args.n} sessions per step, {args.turns} turns, start-up "
          f"{args.startup_s:g} s, tool {args.tool_s:g} s, {args.mean_tokens:g} tokens mean, train {args.train_s:g} s")
    print(f"{'mode':<12} {'samples/s':>10} {'engine busy':>12} {'rollout s/step':>15} {'vs sync':>8} "
          f"{'older weights':>14} {'slots busy':>11}")
    for mode, r in results.items():
        print(f"{mode:<12} {r['samples_per_s']:>10.2f} {r['busy']:>11.1%} {r['rollout_s']:>15.2f} "
              f"{r['samples_per_s'] / base:>7.2f}x {r['mixed']:>13.0%} {r['slots']:>10.1%}")
    print(f"steps 2..{args.steps - 1} (the last step is left out: under fully_async it drains the pool and trains "
          "with nothing left to generate); older weights: share of trained tokens sampled by a weight version behind "
          f"the one trained (1 - train/version_lag/0); slots busy: mean share of the {agent_slots(args)} agent "
          "slots (runtime.concurrency groups x n) held by a running agent, the ceiling of any mode's rate with this "
          "concurrency (at 100% only more slots or shorter sessions go faster)")
    run_base = results["sync"]["run_samples_per_s"]
    print(f"steps 2..{args.steps}, the last included: " + ", ".join(
        f"{mode} {r['run_samples_per_s']:.2f} samples/s, busy {r['run_busy']:.1%}, "
        f"{r['run_samples_per_s'] / run_base:.2f}x" for mode, r in results.items()))
    startup_removed(args)


def startup_removed(args: argparse.Namespace) -> None:
    """Short sessions, one turn: the step time is start-up plus a little generation; the optimizer step
    (start-up + 0.5 s) is long enough to hide it, as real optimizer steps are."""
    train_s = args.startup_s + 0.5
    short = (args.startup_s, 1, 0.0, 32)
    sync = measure("sync", args, short, train_s, 8.0)["rollout_s"]
    bare = measure("sync", args, (0.0, 1, 0.0, 32), train_s, 8.0)["rollout_s"]
    pre = measure("prelaunch", args, short, train_s, 8.0)["rollout_s"]
    print(f"start-up: sync {sync:.2f} s/step, sync without start-up {bare:.2f}, prelaunch {pre:.2f}; prelaunch "
          f"removes {(sync - pre) / (sync - bare):.0%} of the {sync - bare:.2f} s start-up cost")


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"(bench took {time.time() - started:.0f} s)")
