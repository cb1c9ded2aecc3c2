"""Where a learning step's time goes: a learning preset (`experiment=smollm2_arith`, or `--experiment
smollm2_agent`, the multi-turn calculator agent) for a few steps, its mean step, the split and the memory peak.

Runs the preset in-process (`relax_pipeline.run.run`) for `--steps` training steps with the held-out eval off
(it is not part of a step), the rollout dump on, in a temporary folder, and reads back `metrics.jsonl` and the
dump. The first step is printed apart (it warms the page cache, the allocator and the prefix cache); the mean
is over the others. Per step:

- rollout (wall): every session of the step, started to scored, of which
  - prefill and decode: the embedded engine's worker seconds in admission rounds and in decode steps
    (`engine/prefill_s`, `engine/decode_s`); the worker is one thread, so these add up to at most the wall;
  - agents: the mean agent process life outside its model calls (spawn to exit minus the turns' `total_ms`:
    interpreter start, reading the input, the reply's parsing, writing the output, exit), how many sessions
    the step started (the drop-uniform filter replaces the groups it rejects) and how many of them were
    prelaunched (`runtime=prelaunch`: started during the step before, their start-up behind its training);
  - scoring: `perf/reward_s`, the reward stage's seconds summed over groups (the arith agent scores its own
    answer, so this is the credit computation only);
- train: `perf/train_time` (the optimizer step over the kept samples);
- weight sync: `perf/weight_sync_s` (trainer weights into the engine).

Last, the peak resident memory of the pipeline's process (`ru_maxrss`: engine, gateway and trainer together;
target at most 4 GB) and of the largest reaped child process, and the CPU seconds of the whole run
(every step and the start-up): the pipeline's own process (engine, gateway, trainer) against its reaped child
processes (the agents), per session, from `getrusage`. On a
2-core machine both draw on the same two cores, so an agent's start-up CPU is time the engine waits for.

The target on a 2-core machine is a mean step of at most 25 s. Nothing here is asserted; the numbers depend on
the machine and its load.

`--lora` runs the preset and its LoRA preset (`experiment=<preset>_lora`, trainer.lora) one after the other, each in
its own process, and prints them side by side (bench/_learning_lora.py): training step, weight sync, checkpoint size
and peak resident memory, full against adapter, the load average with each, and with `--eval` the held-out success
of both at the same wall time.

`--model tiny` runs the preset on the tiny test model instead of SmolLM2 (`--smoke` does, with one small group a
step and no filter: the tiny model's rewards are all alike, so the drop-uniform filter would reject every group).

With `--eval` the preset's own eval stays on and its curve is printed after the timings: per eval, the steps done,
the minutes from the start, and each eval dataset's success (and, for `experiment=smollm2_chain`, calls a session,
chaining and success by calls needed); `--output DIR` keeps the run folder (eval.csv, eval_curve.png).

    python bench/learning.py [--experiment smollm2_agent] [--steps 5] [--model tiny] [--smoke] [--eval]
                             [--output DIR] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _learning_lora  # noqa: E402
from _smoke import parse_args  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from relax_pipeline.config import CONF_DIR, quote_placeholders, register  # noqa: E402
from relax_pipeline.run import run  # noqa: E402

COLUMNS = (("step s", "perf/step_time"), ("rollout s", "perf/rollout_time"), ("prefill s", "engine/prefill_s"),
           ("decode s", "engine/decode_s"), ("scoring s", "perf/reward_s"), ("train s", "perf/train_time"),
           ("sync s", "perf/weight_sync_s"))
EVAL_COLUMNS = (("success", "raw_reward"), ("calls", "calls/mean"), ("chained", "chained/mean"),
                ("linked", "linked/mean"), ("1-call", "solved_1/mean"), ("2-call", "solved_2/mean"),
                ("3-call", "solved_3/mean"))
"""What `--eval` prints per eval dataset, when its rows carry it (`experiment=smollm2_chain`'s agent does)."""
SMOKE_OVERRIDES = ["rollout.batch_size=1", "rollout.n_samples_per_prompt=2", "rollout.over_sampling_batch_size=1",
                   "credit.filter_path=null", "engine.max_batch_size=4"]
"""What `--smoke` adds: one group of two sessions a step, no filter."""


def run_preset(folder: Path, experiment: str, steps: int, extra: list[str], evaluate: bool = False) -> None:
    register()
    no_eval = [] if evaluate else ["eval.interval=null", "eval.datasets=[]"]
    overrides = [f"experiment={experiment}", f"rollout.num_steps={steps}", *no_eval,
                 f"output_dir={folder}", f"debug.save_rollout_data={folder}/dump/r_{{rollout_id}}.jsonl", *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders(overrides))
    run(cfg)


def step_rows(folder: Path) -> list[dict]:
    """Each step's metrics (from `metrics.jsonl`) with the agent figures of its dump added."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [dict(r["metrics"], step=r["step"]) for r in rows if "perf/step_time" in r["metrics"]]
    for step in steps:
        step.update(agent_figures(folder / "dump" / f"r_{step['step']}.jsonl"))
    return steps


def agent_figures(dump: Path) -> dict[str, float]:
    """Sessions the step started, how many of them were prelaunched (started held, during the step before), and
    their mean agent life outside model calls (seconds): spawn (the `waiting` mark of a held session, else
    `running`) to exit, less the turns' `total_ms`. `agent_s` starts at `running`, which a held session reaches
    only when its step leases it, after its first request already waits: it cannot be used for these."""
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    outside = [agent_life(r["timing"]) - sum(t["total_ms"] for t in r["timing"].get("turns") or [] if t) / 1000
               for r in rows if "exited" in r["timing"]]
    return {"sessions": float(len(rows)), "prelaunched": float(sum("waiting" in r["timing"] for r in rows)),
            "agent_outside_s": statistics.fmean(outside) if outside else 0.0}


def agent_life(timing: dict) -> float:
    """Seconds from the agent's spawn to its exit."""
    return timing["exited"] - timing.get("waiting", timing.get("running", timing["exited"]))


def report(steps: list[dict]) -> None:
    header = "".join(f"{name:>11}" for name, _ in COLUMNS)
    header += f"{'sessions':>10}{'prelaunched':>12}{'agent s':>9}{'kept':>6}"
    print(f"{'':>8}{header}")
    for step in steps:
        print(f"{'step ' + str(int(step['step'])):>8}" + line(step))
    measured = steps[1:] or steps
    mean = {key: statistics.fmean(s.get(key, 0.0) for s in measured) for key in measured[0]}
    print(f"{'mean':>8}" + line(mean) + f"   (steps {int(measured[0]['step'])}-{int(measured[-1]['step'])})")
    rest = mean["perf/rollout_time"] - mean.get("engine/prefill_s", 0.0) - mean.get("engine/decode_s", 0.0)
    print(f"mean step {mean['perf/step_time']:.1f} s (target <= 25 s); of the rollout's "
          f"{mean['perf/rollout_time']:.1f} s the engine prefilled {mean.get('engine/prefill_s', 0.0):.1f} s and "
          f"decoded {mean.get('engine/decode_s', 0.0):.1f} s; the other {rest:.1f} s are agents starting and "
          f"exiting ({mean['sessions']:.0f} sessions, {mean['prelaunched']:.0f} of them prelaunched during the step "
          f"before; {1000 * mean['agent_outside_s']:.0f} ms each outside model calls), the gateway and waiting")


def line(step: dict) -> str:
    cells = "".join(f"{step.get(key, float('nan')):>11.1f}" for _, key in COLUMNS)
    return (cells + f"{step.get('sessions', 0):>10.0f}{step.get('prelaunched', 0):>12.0f}"
            f"{step.get('agent_outside_s', 0) * 1000:>7.0f}ms"
            f"{step.get('rollout/kept_fraction', float('nan')):>6.2f}")


def eval_rows(folder: Path, started: float) -> list[tuple[int, float, dict[str, float]]]:
    """(steps done, minutes from `started`, metrics) of every logged eval, from `metrics.jsonl`."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], (r["time"] - started) / 60, r["metrics"]) for r in rows
            if any(key.startswith("eval/") for key in r["metrics"])]


def report_eval(rows: list[tuple[int, float, dict[str, float]]]) -> None:
    """Per eval, each dataset's success and the agent's own figures when it reports them (the calculator's
    calls a session, the share of sessions whose second call used the first call's value, success by calls
    needed)."""
    for step, minutes, metrics in rows:
        print(f"eval after {step} steps, {minutes:.1f} min from the start:")
        for name in dict.fromkeys(key.split("/")[1] for key in metrics if key.startswith("eval/")):
            cells = [f"{label} {metrics[f'eval/{name}/{key}']:.3f}" for label, key in EVAL_COLUMNS
                     if f"eval/{name}/{key}" in metrics]
            print(f"  {name:<14}" + "  ".join(cells))


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def report_memory() -> None:
    """Peak resident memory of this process and of the largest reaped child (Linux reports KiB)."""
    main_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    child_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"peak resident memory: pipeline process {main_gb:.2f} GB (target <= 4 GB), largest reaped child process "
          f"{child_gb:.2f} GB (an agent, or a fork of the pipeline before its exec)")


def report_cpu(main_s: float, agents_s: float, sessions: int) -> None:
    print(f"CPU over the whole run: pipeline process {main_s:.1f} s, agent processes {agents_s:.1f} s "
          f"({1000 * agents_s / max(sessions, 1):.0f} ms each over {sessions} sessions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", default="smollm2_arith", help="the preset: smollm2_arith or smollm2_agent")
    parser.add_argument("--steps", type=int, default=5, help="training steps (the first is printed apart)")
    parser.add_argument("--model", default=None, help="model=<name> instead of the preset's smollm2, e.g. tiny")
    parser.add_argument("--eval", action="store_true", help="keep the preset's eval and print its curve")
    parser.add_argument("--output", default=None, help="run in this folder and keep it (eval.csv, eval_curve.png)")
    parser.add_argument("--lora", action="store_true", help="the preset and <experiment>_lora side by side, each in "
                        "its own process (bench/_learning_lora.py)")
    parser.add_argument("--summary", default=None, help=argparse.SUPPRESS)  # --lora's children write their figures
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. engine.max_batch_size=64")
    args = parse_args(parser, steps=2, model="tiny")
    if args.lora:
        flags = [f"--steps={args.steps}"] + [f"--model={args.model}"] * bool(args.model)
        _learning_lora.compare(Path(__file__), args.experiment, flags + ["--eval"] * args.eval + ["--smoke"] *
                               args.smoke, args.overrides)
        return
    extra = [f"model={args.model}"] if args.model else []
    extra += (SMOKE_OVERRIDES if args.smoke else []) + args.overrides
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.output or tmp)
        before = cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)
        started, load = time.time(), os.getloadavg()
        run_preset(folder, args.experiment, args.steps, extra, args.eval)
        main_s = cpu_seconds(resource.RUSAGE_SELF) - before[0]
        agents_s = cpu_seconds(resource.RUSAGE_CHILDREN) - before[1]
        steps = step_rows(folder)
        report(steps)
        if args.eval:
            report_eval(eval_rows(folder, started))
        report_cpu(main_s, agents_s, int(sum(s["sessions"] for s in steps)))
        report_memory()
        if args.summary:
            figures = _learning_lora.summary(folder, steps, eval_rows(folder, started) if args.eval else [], load)
            Path(args.summary).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
