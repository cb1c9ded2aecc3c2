"""Agents on Ray vs local subprocesses: 256 sleeping agents through the real gateway, side by side in one run.

Each session is `examples/long_tail_agent` (standard-library HTTP): it sleeps a seeded 1-3 s, then makes 4 model
calls through the gateway to a paced fake engine (`testing.engines.PacedEngine`, a few tokens per call), and
exports. One step holds all 256 sessions at once (`--groups` groups x `--n` sessions, every group resident).
The same run config goes once with `agent.executor=local` and once with `agent.executor=ray` on a local 2-node
Ray cluster (`testing.ray_cluster.separate_cluster`: head + one worker, sessions spread over both, the cluster's
processes in a session of their own; the default `ray.node_tmpdir=null`, so the nodes keep session files in
/dev/shm where it is memory-backed). Each mode runs 2 steps; the second is measured (the first warms the page
cache and starts Ray's per-node runners).

Printed per mode: sessions/s over the measured step (256 / its rollout time), the mean agent time per session
(`timing.agent_s` of the dump: the session marked running → its agent exited) and the mean time to done (the
step's start, its first session's `created` mark → the session's `exited` mark). Ray's overhead per session is
the difference of the time-to-done means (what Ray adds to each session's life: queueing the call, shipping the
input, the spawn on the node, the answer back); target < 50 ms.

The executor-only part (alone with `--executor-only`): shell agents that only sleep, started through the
executors without the pipeline (`executor_cost`), local, on Ray's defaults and, where the default folder is in
memory, on Ray with the session files on this machine's disk (`ray.node_tmpdir` = its temp folder, the default
before); printed: ms beyond the sleep, Ray's overhead (target < 50 ms) and the nodes' runner CPU per session
(target < 2 ms; what the runners use with no session running, Ray's own threads, about 5 ms a second each, taken
out), each the median over `--repeats` runs with every run's figure, and the median of the runs' mean phases of the
Ray sessions' `ray: timing ms:` lines (where a Ray session's time goes), and each mode's CPU per session of the
whole machine (/proc/stat; every process and the kernel, the idle background taken out). Odd runs take the modes in
reverse order, so load that rises or falls over the runs weighs on local and Ray alike; the load average at each
run's end is printed. An unreported run first warms every mode up: the first 256 spawns of a process are slower
(local subprocesses measured 300-320 ms beyond their sleep first, 190-240 after), which made the first run's Ray
overhead read near zero.

The same comparison again with `--few` sessions (16) shows where Ray's overhead comes from: with few, no session
waits for another's start, so what is left is Ray's own latency (the call to the node, the spawn there, the answer
back); with 256 at once on this machine's 2 cores, each spawn also queues behind the others' on the cores that run
both nodes, the driver and Ray's processes. Printed (`report_scaling`): Ray's overhead at both sizes, its growth per
session started at once per core, the sessions per core that fit in 50 ms at that rate, and what the runners' CPU per
session alone predicts when queued on the cores (half of it per session ahead on the same core, on average).

Why not the difference of `agent_s` (what this bench printed first): its start point is not the same in both
modes. A local session is marked running just before its own spawn, and the prepare stage spawns one session
after the other, so a local session's clock starts only once the sessions before it are spawned (at 256 agents on
2 busy cores the last one starts ~9 s into the step, uncounted); a Ray session is marked running at once and its
clock includes its wait for the node to spawn it. The step's start is the same point for both.

Why the cluster runs in its own session (it first ran inside this process): Linux's autogroup scheduler shares CPU
fairly between sessions, and every agent is a session of its own. A cluster started here put all of Ray's
processes (GCS, both raylets, both agent runners) in the driver's session, so the gateway, which serves every
agent's turns, and the nodes split one share of the CPU while the local run's driver had that share alone: on 2
busy cores that cost each Ray session about 2 s (same runtime, 2 cores shared with another workload: +2.2 s over
local with the cluster in-process, one run; -2.1 to +2.6 s, mean +0.3 s, over five runs with the cluster in its
own session). On separate machines the nodes never take the driver's share.

    python bench/agents_ray.py [--groups 64] [--n 4] [--turns 4] [--repeats 3] [--executor-only] [--sleep-s 3]
                               [--few 16] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _smoke import parse_args  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from relax_pipeline.agent.executors import new_agent  # noqa: E402
from relax_pipeline.agent.launcher import AgentSpec  # noqa: E402
from relax_pipeline.agent.ray_executor import runner_pool, warm_up  # noqa: E402
from relax_pipeline.agent.ray_node import memory_backed, session_root  # noqa: E402
from relax_pipeline.config import CONF_DIR, quote_placeholders, register  # noqa: E402
from relax_pipeline.infra import ray_runtime  # noqa: E402
from relax_pipeline.run import run  # noqa: E402
from relax_pipeline.testing.engines import register_paced  # noqa: E402
from relax_pipeline.testing.ray_cluster import separate_cluster  # noqa: E402

TIMING = "ray: timing ms: "
"""The line `agent/ray_executor.timing_note` writes into each Ray session's agent.log."""


def seeded_sleeps(count: int, longest_s: float, seed: int) -> list[float]:
    """`count` seeded sleeps between a third of `longest_s` and `longest_s` (1-3 s by default)."""
    rng = random.Random(seed)
    return [round(rng.uniform(longest_s / 3, longest_s), 3) for _ in range(count)]


def workload(folder: Path, sessions: int, turns: int, longest_s: float, seed: int = 0) -> Path:
    """One row per prompt: a seeded sleep (`seeded_sleeps`) before `turns` model calls."""
    rows = [{"input": f"task {i}", "metadata": {"startup_s": sleep, "turns": turns,
                                                "tool_mean_s": 0.0, "max_tokens": 8}}
            for i, sleep in enumerate(seeded_sleeps(sessions, longest_s, seed))]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(folder: Path, data: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        "job=rollout", f"output_dir={folder}", f"dataset.path={data}", "dataset.shuffle=false", "agent=long_tail",
        "agent.timeout=600", "engine=paced", "engine.token_s=0.001",
        "engine.mean_tokens=4", "engine.sigma=0.3", "rollout.num_steps=2", f"rollout.batch_size={args.groups}",
        f"rollout.n_samples_per_prompt={args.n}", f"runtime.concurrency={args.groups}", "rollout.max_response_len=16",
        f"debug.save_rollout_data={folder}/r_{{rollout_id}}.jsonl", *extra,
    ]


def measure(args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    """One run of 2 steps; figures of the second."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = workload(folder, args.groups, args.turns, args.sleep_s)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=quote_placeholders(overrides(folder, data, args, extra)))
        run(cfg)
        rows = [json.loads(line) for line in (folder / "r_1.jsonl").read_text().splitlines()]
        rollout_s = _rollout_time(folder / "run.log", step=1)
        ok = [r for r in rows if r["status"] in ("completed", "truncated")]
        phases = ray_phases(folder / "sessions", ok)
    if len(ok) != args.groups * args.n:
        raise SystemExit(f"expected {args.groups * args.n} finished sessions, got {len(ok)} of {len(rows)} rows")
    start = min(r["timing"]["created"] for r in rows)
    return {"sessions_per_s": len(ok) / rollout_s, "rollout_s": rollout_s,
            "agent_s": statistics.fmean(r["timing"]["agent_s"] for r in ok),
            "done_s": statistics.fmean(r["timing"]["exited"] - start for r in ok), **phases}


def ray_phases(io_root: Path, rows: list[dict]) -> dict[str, float]:
    """Mean ms of each phase of the `ray: timing ms:` line in the sessions' agent.log (none for local agents)."""
    phases = phase_means([io_root / f"{row['group_id']}-{row['index']}" for row in rows])
    return {f"phase {label}": ms for label, ms in phases.items()}


def phase_means(io_dirs: list[Path]) -> dict[str, float]:
    """Mean ms of each phase of the `ray: timing ms:` line in these sessions' agent.log (none for local agents)."""
    phases: dict[str, list[float]] = {}
    for io_dir in io_dirs:
        log = (io_dir / "agent.log").read_text(errors="replace")
        line = next((x for x in log.splitlines() if x.startswith(TIMING)), None)
        for part in line[len(TIMING):].split(", ") if line else []:
            label, _, ms = part.strip().rpartition(" ")
            phases.setdefault(label, []).append(float(ms))
    return {label: statistics.fmean(values) for label, values in phases.items()}


def _rollout_time(log: Path, step: int) -> float:
    for line in log.read_text().splitlines():
        if f"step {step} metrics" in line and "perf/rollout_time=" in line:
            return float(line.split("perf/rollout_time=")[1].split()[0])
    raise SystemExit(f"no step {step} metrics in {log}")


@dataclass(frozen=True)
class Cost:
    """One executor's figures in one run of the executor-only comparison; connects `executor_cost` to the report."""

    beyond_s: float
    """Mean seconds a session lived beyond its own sleep."""
    runner_cpu_s: float | None
    """Ray: CPU seconds of the nodes' runner processes per session, their idle background taken out (what the
    runners use with no session, measured for `IDLE_S` before the clock starts); None for local agents."""
    idle_cpu_s: float | None
    """Ray: the runners' idle background per session over the same time (taken out of `runner_cpu_s`)."""
    machine_cpu_s: float
    """CPU seconds per session of the whole machine (every process: this driver, Ray's, the agents' shells, the
    kernel's work for them), the machine's background before the clock (the cluster up, no session) taken out."""
    phases: dict[str, float]
    """Ray: mean ms of each phase of the sessions' `ray: timing ms:` lines (`phase_means`); empty for local."""
    load: float
    """The 1-minute load average when the run ended (this machine's other work shows here)."""


SLEEPER = 'sleep "$(cat "$RELAX_INPUT_JSON")"'
"""The light agent of the executor-only measurement: a shell sleeping the seconds its input file holds."""


async def executor_cost(executor: str, address: str | None, sleeps: list[float], folder: Path,
                        node_tmpdir: str | None = None) -> Cost:
    """Mean seconds each session lives beyond its own sleep, from one common start to its `wait` returning, for
    len(sleeps) shell agents that only sleep (no interpreter, no model call), all started at once through the
    executor alone (`new_agent`: start, wait), without the pipeline. The sessions' folders and input files are
    written before the clock starts (the pipeline's part in both modes). On Ray also the CPU seconds per session
    of the nodes' runner processes (`NodeRunner.cpu_seconds`, the agents' own processes not counted)."""
    ray = {"address": address, "node_tmpdir": node_tmpdir} if address else {}
    spec = AgentSpec(command=SLEEPER, executor=executor, ray=ray)
    if executor == "ray":
        await warm_up(spec)  # as the run does at start-up: the nodes' runners are up before the first session
    idle_rate, machine_idle_rate = await idle_rates(spec)
    cpu_before, machine_before = await runners_cpu(spec), machine_busy_s()
    agents = [new_agent(spec) for _ in sleeps]
    io_dirs = [folder / f"{executor}-{node_tmpdir is not None}" / str(i) for i in range(len(sleeps))]
    for io_dir, sleep in zip(io_dirs, sleeps, strict=True):
        io_dir.mkdir(parents=True)
        (io_dir / "input.json").write_text(f"{sleep}")
    begin = time.monotonic()
    for i, (agent, io_dir) in enumerate(zip(agents, io_dirs, strict=True)):
        await agent.start({"RELAX_SESSION_ID": f"{executor}-{i}", "RELAX_INPUT_JSON": str(io_dir / "input.json"),
                           "RELAX_OUTPUT_JSON": str(io_dir / "output.json")}, io_dir)

    async def beyond(agent: object, sleep: float) -> float:
        await agent.wait()  # type: ignore[attr-defined]
        return time.monotonic() - begin - sleep

    try:
        mean = statistics.fmean(await asyncio.gather(*(beyond(a, s) for a, s in zip(agents, sleeps, strict=True))))
        machine_after, cpu_after, elapsed = machine_busy_s(), await runners_cpu(spec), time.monotonic() - begin
        machine = (machine_after - machine_before - machine_idle_rate * elapsed) / len(sleeps)
        phases, load = phase_means(io_dirs), os.getloadavg()[0]
        if cpu_before is None or cpu_after is None or idle_rate is None:
            return Cost(mean, None, None, machine, phases, load)
        idle = idle_rate * elapsed / len(sleeps)
        return Cost(mean, (cpu_after - cpu_before) / len(sleeps) - idle, idle, machine, phases, load)
    finally:
        ray_runtime.shutdown()


IDLE_S = 1.0
"""Seconds over which the runners' idle CPU is measured before the clock starts."""


async def idle_rates(spec: AgentSpec) -> tuple[float | None, float]:
    """CPU seconds per second with no session: the runners' (Ray's own threads; None for local agents) and the
    whole machine's (`machine_busy_s`), over the same `IDLE_S`."""
    before, machine_before = await runners_cpu(spec), machine_busy_s()
    await asyncio.sleep(IDLE_S)
    after, machine_after = await runners_cpu(spec), machine_busy_s()
    runners = None if before is None or after is None else (after - before) / IDLE_S
    return runners, (machine_after - machine_before) / IDLE_S


def machine_busy_s() -> float:
    """CPU seconds the machine's cores have been busy since boot, all processes and the kernel: /proc/stat's `cpu`
    line (clock ticks) in user, nice, system, irq and softirq (not idle, I/O wait, stolen or guest time)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return sum(ticks[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


async def runners_cpu(spec: AgentSpec) -> float | None:
    """CPU seconds used so far by the runners of every node, None for local agents."""
    if spec.executor != "ray":
        return None
    runners = runner_pool(spec).runners.values()
    return sum(await asyncio.gather(*(runner.actor.cpu_seconds.remote() for runner in runners)))


def executor_costs(address: str, sessions: int, longest_s: float, run: int = 0) -> dict[str, Cost]:
    """`executor_cost` for local subprocesses, for Ray on its defaults (`ray.node_tmpdir=null`: the node's choice,
    `ray_node.session_root`), and, where that choice is memory-backed, for Ray with the session files on this
    machine's disk (`ray.node_tmpdir` set to the temp folder, the default before), on the same seeded sleeps.
    Odd runs go in the reverse order, so a machine getting busier or quieter during the runs weighs on each mode
    alike (the local run first and last in turn)."""
    waits = seeded_sleeps(sessions, longest_s, seed=1)
    default, disk = session_root(None, "this machine"), tempfile.gettempdir()
    modes: dict[str, tuple[str, str | None, str | None]] = {
        "local subprocesses": ("local", None, None), f"ray (default: {default.path})": ("ray", address, None)}
    if default.memory and not memory_backed(disk):
        modes[f"ray, node_tmpdir={disk} (disk)"] = ("ray", address, disk)
    order = list(modes) if run % 2 == 0 else list(reversed(modes))
    with tempfile.TemporaryDirectory() as tmp:
        costs = {name: asyncio.run(executor_cost(modes[name][0], modes[name][1], waits, Path(tmp), modes[name][2]))
                 for name in order}
    return {name: costs[name] for name in modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=64, help="prompt groups per step (all resident)")
    parser.add_argument("--n", type=int, default=4, help="sessions per group")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the executor-only comparison (median shown)")
    parser.add_argument("--executor-only", action="store_true", help="skip the runs through the gateway")
    parser.add_argument("--sleep-s", type=float, default=3.0, help="longest agent sleep (the shortest is a third)")
    parser.add_argument("--few", type=int, default=16,
                        help="sessions of the executor-only comparison's second size (Ray's latency without a queue)")
    args = parse_args(parser, groups=1, n=2, turns=1, repeats=1, sleep_s=0.3, few=1)
    sessions = args.groups * args.n
    if not 0 < args.few < sessions:
        parser.error(f"--few {args.few}: between 1 and the sessions of a step less one (--groups x --n = {sessions})")
    register()
    register_paced()
    local = None if args.executor_only else measure(args, ["agent.executor=local"])
    with separate_cluster(workers=1, cpus=2, head_cpus=2) as address:
        on_ray = None if local is None else measure(args, ["agent.executor=ray", f"ray.address={address}"])
        executor_costs(address, sessions, args.sleep_s / 10)  # not reported: the first 256 spawns of a process are slow
        light = [executor_costs(address, sessions, args.sleep_s, run) for run in range(args.repeats)]
        few = [executor_costs(address, args.few, args.sleep_s, run) for run in range(args.repeats)]
    if local is not None and on_ray is not None:
        report_pipeline(args, local, on_ray)
    report_executors(sessions, light, args.sleep_s)
    report_executors(args.few, few, args.sleep_s)
    report_scaling(args.few, sessions, few, light)


def report_pipeline(args: argparse.Namespace, local: dict[str, float], on_ray: dict[str, float]) -> None:
    """The table of the two runs through the gateway, Ray's overhead on the time to done, and its phases."""
    print(f"{args.groups * args.n} sleeping agents ({args.sleep_s / 3:g}-{args.sleep_s:g} s, {args.turns} turns "
          "through the gateway), all at once; 2nd of 2 steps")
    print(f"{'executor':<28} {'sessions/s':>10} {'rollout s':>10} {'agent s/session':>16} {'done s/session':>15}")
    for name, r in (("local subprocesses", local), ("ray, local 2-node cluster", on_ray)):
        print(f"{name:<28} {r['sessions_per_s']:>10.1f} {r['rollout_s']:>10.2f} {r['agent_s']:>16.3f} "
              f"{r['done_s']:>15.3f}")
    overhead_ms = (on_ray["done_s"] - local["done_s"]) * 1000
    print(f"Ray overhead per session: {overhead_ms:+.1f} ms (mean time from the step's start to the session's exit, "
          f"Ray - local; target < 50 ms); throughput ratio Ray/local "
          f"{on_ray['sessions_per_s'] / local['sessions_per_s']:.2f}")
    report_phases(on_ray)


def report_executors(sessions: int, runs: list[dict[str, Cost]], longest_s: float) -> None:
    """The executor-only comparison: each mode's ms beyond the sleep, Ray's overhead (Ray - local of the same run)
    and the runners' CPU per session, the median over the runs and every run's figure."""
    print(f"Executors alone, {sessions} shell agents that only sleep {longest_s / 3:g}-{longest_s:g} s (no "
          f"interpreter start, no model calls), all started at once, {len(runs)} runs; ms beyond its sleep per "
          "session, median [each run]:")
    for name in runs[0]:
        print(f"  {name:<32} {_figures([1000 * run[name].beyond_s for run in runs], '6.0f', '.0f')}; machine CPU "
              f"{_figures([1000 * run[name].machine_cpu_s for run in runs], '.2f', '.2f')} ms/session")
        if name != "local subprocesses":
            extra = overheads(runs, name)
            cpu = [1000 * (run[name].runner_cpu_s or 0.0) for run in runs]
            idle = [1000 * (run[name].idle_cpu_s or 0.0) for run in runs]
            print(f"  {'':<32} Ray overhead {_figures(extra, '+.1f', '+.0f')} ms (target < 50 ms); runner CPU "
                  f"{_figures(cpu, '.2f', '.2f')} ms/session (target < 2 ms; Ray's idle background, taken out: "
                  f"{statistics.median(idle):.2f})")
            phases = {label: statistics.median(run[name].phases.get(label, 0.0) for run in runs)
                      for label in runs[0][name].phases}
            print(f"  {'':<32} phases, median of the runs' mean ms: "
                  + ", ".join(f"{label} {ms:.1f}" for label, ms in phases.items()))
    print(f"  load average (1 min) at each run's end: {', '.join(f'{run[n].load:.1f}' for run in runs for n in run)}")


def overheads(runs: list[dict[str, Cost]], name: str) -> list[float]:
    """Ray's overhead of mode `name` in each run, ms: its ms beyond the sleep less local subprocesses' in that run."""
    return [1000 * (run[name].beyond_s - run["local subprocesses"].beyond_s) for run in runs]


def report_scaling(few: int, many: int, few_runs: list[dict[str, Cost]], many_runs: list[dict[str, Cost]]) -> None:
    """Ray's overhead with `few` and with `many` sessions started at once (medians of the runs), per Ray mode. With
    few, no session waits for another's start: what remains is Ray's own latency (the call to the node, the spawn
    there, the answer back). With many, each session's spawn also queues behind the others' on the cores that run
    the nodes (and, on one machine, the driver and Ray's own processes), so the overhead grows with the sessions
    started at once per core; printed: that growth per session per core, and how many sessions per core may start
    at once within the 50 ms target at that rate (on a cluster each node's cores take its own sessions)."""
    cores = len(os.sched_getaffinity(0))
    print(f"Ray's overhead by sessions started at once on {cores} cores, median of the runs:")
    for name in (n for n in many_runs[0] if n != "local subprocesses"):
        low, high = statistics.median(overheads(few_runs, name)), statistics.median(overheads(many_runs, name))
        slope = (high - low) / ((many - few) / cores)
        within = few / cores + (50.0 - low) / slope if slope > 0 and low < 50.0 else float("nan")
        runner_ms = 1000 * statistics.median(run[name].runner_cpu_s or 0.0 for run in many_runs)
        queued = runner_ms * (many - few) / cores / 2
        print(f"  {name:<32} {few}: {low:+.1f} ms (Ray's own latency), {many}: {high:+.1f} ms; "
              f"{slope:+.2f} ms per session started at once per core; within 50 ms up to {within:.0f} per core; the "
              f"runners' CPU ({runner_ms:.2f} ms/session) queued on the cores alone: {low:+.1f} + {runner_ms:.2f} x "
              f"{(many - few) / cores:g} / 2 = {low + queued:+.1f} ms")


def _figures(values: list[float], median: str, each: str) -> str:
    """`median [each, run]` of `values` in the given formats."""
    return f"{statistics.median(values):{median}} [{', '.join(f'{v:{each}}' for v in values)}]"


def report_phases(on_ray: dict[str, float]) -> None:
    """Where a Ray session's time went, and Ray's own part of it: the phases other than waiting in the driver
    (`queued`, which local sessions also do, one spawn after the other) and the agent itself."""
    phases = {key.removeprefix("phase "): value for key, value in on_ray.items() if key.startswith("phase ")}
    print("Ray session phases, mean ms: " + ", ".join(f"{label} {ms:.1f}" for label, ms in phases.items()))
    own = sum(ms for label, ms in phases.items() if label not in ("queued", "agent"))
    print(f"Ray's own part per session (submit, call to node, spawn, wrap-up, answer back): {own:.1f} ms "
          "(target < 50 ms); the rest of the difference above is the agents' own turns and sleeps running slower "
          "beside the cluster's processes on the same cores")


if __name__ == "__main__":
    main()
