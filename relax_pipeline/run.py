"""`run(cfg)`: build the run's objects from the composed config, run the job, return its metrics.

Jobs: `train` (rollout, credit, training and weight sync per step; checkpoints), `rollout` (rollout
steps, credit, dump; no training), `check` (validate the config, the model, the dataset and the agent
setup, then run `check.sessions` real sessions and certify what they recorded: `relax_pipeline/certify/`,
`check/certificate.json`), `eval` (evaluate `model.path`, a base model or any checkpoint folder, on every
`eval.datasets` entry once: metrics, `eval_<name>.csv` per dataset, one summary line each; no steps, no training;
its eval groups in flight default to filling the engine's batch, `engine.max_batch_size`, unless
`runtime.eval_concurrency` is set), `view` (serve the run viewer, `relax_pipeline/view/`, on `view.dir` or
`output_dir` until interrupted; it builds nothing else) and `replay` (re-execute one recorded step's credit and
loss from its replay bundle, `relax_pipeline/replay/`, with no engine and no agents).
Every step's metrics also go to `metrics.jsonl` (`tracking/metrics_file.py`). Everything is built here, in one
place: `config.records` turns the composed config into one record per node, and `build` calls the class a
record's `_target_` names with it and the live collaborators the run hands it; the step loop itself is
`loop.py`. `__main__` stays thin and tests call `run` in-process. A failed run raises after logging, as its
last line, one sentence saying why.

Signals (`StopSignals`, main thread only): the first SIGINT or SIGTERM asks the step loop to stop
(`StepLoop.request_stop`: running sessions dropped, a checkpoint of the last finished step, then
`RunInterrupted`, logged as the last line with where the checkpoint is and how to resume; `__main__`
exits 130 or 143 without a traceback). A second one kills the running agents and exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from relax_pipeline.agent.launcher import AgentSpec
from relax_pipeline.agent.ray_executor import warm_up
from relax_pipeline.agent.services import Services, service_problems
from relax_pipeline.certify.certificate import Cause, Stage
from relax_pipeline.certify.check import CheckKeys, certify_sessions, conclude, config_stage, start_failed
from relax_pipeline.certify.evidence import RuntimeKeys
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.config import (
    Config,
    check_context_len,
    multi_context_missing,
    records,
    register,
    replay_run,
    validate,
)
from relax_pipeline.data.dataset import DataSource
from relax_pipeline.data.settings import with_source
from relax_pipeline.engine.settings import EngineRun
from relax_pipeline.gateway.app import create_app
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.infra import ray_runtime
from relax_pipeline.loop import Checkpoints, RunInterrupted, StepLoop
from relax_pipeline.models.spec import context_len
from relax_pipeline.replay.job import replay
from relax_pipeline.replay.recorder import StepRecorder
from relax_pipeline.scheduling.base import Binding
from relax_pipeline.stages.capacity import Capacity, EvalLoad, SlotPlan, check_slots
from relax_pipeline.stages.evaluate import EvalSet, Evaluator
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.stages.prepare import AgentPools, Prepare
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.runtime import Runtime
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.tracking.dump import RolloutDump
from relax_pipeline.tracking.logs import run_logging
from relax_pipeline.tracking.metrics_file import MetricsFile
from relax_pipeline.tracking.traces import TraceWriter
from relax_pipeline.train.allocator import (
    bound_cpu_memory,
    cap_kernel_cache,
    keep_freed_cpu_memory,
    wants_freed_memory_kept,
)
from relax_pipeline.train.base import Trainer
from relax_pipeline.train.settings import TrainerRun
from relax_pipeline.turn.service import SamplingDefaults, TurnService
from relax_pipeline.turn.sessions import ForestStore
from relax_pipeline.view.server import serve_view

log = logging.getLogger("relax_pipeline")


def run(cfg: DictConfig) -> dict[str, float]:
    """Run the configured job; returns the last step's metrics (or the check's findings)."""
    register()
    if cfg.job == "view":  # reads a run folder; writes nothing into it (no run.log, no config.yaml)
        return serve_view(cfg.view.dir or cfg.output_dir, cfg.view.host, cfg.view.port, cfg.view.tokenizer)
    if cfg.job == "replay":  # re-runs a bundle's credit and loss on the CPU; starts and writes nothing else
        return replay(replay_run(cfg))
    output_dir = _output_dir(cfg)
    with run_logging(output_dir) as log_path, StopSignals() as signals:
        try:
            config = records(cfg)
            validate(config)
            _allocator(config)
            (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            log.info("job=%s output_dir=%s log=%s", config.job, output_dir, log_path)
            resolved = OmegaConf.to_container(cfg, resolve=True)  # what the tracker records
            return asyncio.run(_run_job(config, resolved, output_dir, signals))
        except RunInterrupted as stop:
            log.warning("%s", stop)
            raise
        except BaseException as error:
            log.error("run failed: %s", _one_sentence(error))
            raise


def _allocator(config: Config) -> None:
    """A training run on the CPU uses one malloc arena, set before any thread starts (train/allocator.py): the
    engine then reuses what training frees, and the reverse. `trainer.keep_freed_memory` picks the policy. Its
    oneDNN kernel cache is capped before the first matmul."""
    t = config.trainer
    if config.job != "train" or t.device.split(":")[0] != "cpu":
        return
    cap_kernel_cache()
    if wants_freed_memory_kept(t.keep_freed_memory, t.device):
        keep_freed_cpu_memory()
    else:
        bound_cpu_memory()


async def _run_job(config: Config, resolved: Any, output_dir: Path, signals: StopSignals) -> dict[str, float]:
    parts = await _Parts.create(config, resolved, output_dir)
    try:
        if config.job == "check":
            return await parts.check()
        await parts.services.start()
        loop = parts.loop()
        signals.attach(asyncio.get_running_loop(), loop.request_stop,
                       lambda: (loop.pipeline.kill_agents(), parts.services.kill()))
        return await loop.run()
    finally:
        signals.detach()
        await parts.close()


class StopSignals:
    """SIGINT and SIGTERM while a run is on: the first asks it to stop (on the event loop), the second kills
    the running agents and exits at once. Installed only in the main thread; the previous handlers come
    back on exit. A first signal that arrives before `attach` (while the model loads) is kept for it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: Callable[[int], None] = lambda signum: None
        self._kill: Callable[[], None] = lambda: None

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[int], None], kill: Callable[[], None]) -> None:
        """From now on a first signal calls `stop(signum)` on `loop` and a second one calls `kill()` first."""
        self._loop, self._stop, self._kill = loop, stop, kill
        if self.signum is not None:
            loop.call_soon(stop, self.signum)

    def detach(self) -> None:
        self._loop = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            sys.stderr.write(f"\n{name} again: killing the running agents and exiting now, without a checkpoint\n")
            self._kill()
            os._exit(128 + signum)
        self.signum = signum
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, signum)
        else:
            sys.stderr.write(f"\n{name}: the run stops once start-up is done (send it again to exit now)\n")


def build(record: Any, *live: Any) -> Any:
    """The object a node configures: the class its record's `_target_` names, called with the record and the
    live collaborators the run hands it (the one way any configured object is made)."""
    return get_class(record._target_)(record, *live)


class _Parts:
    """Every object of one run, built from the config's records."""

    config: Config
    output_dir: Path

    @classmethod
    async def create(cls, config: Config, resolved: Any, output_dir: Path) -> _Parts:
        self = cls()
        self.config, self.resolved, self.output_dir = config, resolved, output_dir
        self.model = build(config.model, config.seed)
        self.model_path = self.model.resolve()
        self.context_len = config.rollout.max_context_len or context_len(self.model_path)
        check_context_len(config.rollout.max_response_len, self.context_len)
        self.protocol = config.protocol
        self.agent = AgentSpec.of(config.agent, asdict(config.sandbox), asdict(config.ray))
        self.eval_agent, self.eval_slots = eval_pool(self.agent, dict(config.eval.agent))
        self.services = Services(self.agent.services, output_dir)  # started by _run_job, never for job=check
        self.dataset = build(config.dataset)
        self.credit = build(config.credit)
        self.capacity = capacity_of(config)
        self.eval_sets = eval_sets(config, self.capacity)
        self.is_eval = config.job == "eval"
        self.strategy = build(config.runtime)
        check_slots(self.slot_plan(), config.runtime.external_slots, self.eval_slots)
        self.tracker = MetricsFile(build(config.tracking, str(output_dir)), output_dir)
        self.engine = build(config.engine, EngineRun(str(self.model_path), config.seed, self.context_len,
                                                     self.model.end_of_turn, str(output_dir), asdict(config.ray)))
        self.trainer = self._trainer() if config.job == "train" else None
        self.server: GatewayServer | None = None
        if config.job != "check":
            await self._serve()
        return self

    def _trainer(self) -> Trainer:
        """The `trainer` node's class, with what the run agreed on: seed, rollout temperature, credit keys."""
        c = self.config
        run = TrainerRun(str(self.model_path), c.seed, c.rollout.temperature, c.credit.advantages,
                         str(self.output_dir), asdict(c.ray))
        return build(c.trainer, run)

    async def _serve(self) -> None:
        cfg = self.config
        runners = asyncio.ensure_future(warm_up(self.agent)) if self.agent.executor == "ray" else None
        try:
            await self.engine.start()
        except BaseException:
            if runners is not None:
                runners.cancel()
            raise
        if runners is not None:
            await runners  # the agents' nodes started while the model loaded
        template = ChatTemplate(self.engine.tokenizer, self.model.end_of_turn)
        r = cfg.rollout
        defaults = SamplingDefaults(r.max_response_len, self.context_len, r.temperature, r.top_p, r.top_k)
        e = cfg.eval
        eval_defaults = SamplingDefaults(e.max_response_len or r.max_response_len, self.context_len, e.temperature)
        self.budgets = {"train": defaults, "eval": eval_defaults}  # Runtime tells the pipeline's length cut by them
        turns = TurnService(template, self.engine, self.protocol.parser(), defaults, r.history, eval_defaults)
        self.store = ForestStore(on_end=turns.end_session)  # an ended session's engine KV is released at once
        g = cfg.gateway  # a loopback gateway also takes a session's id as its credential (docs/design.md §3.3)
        app = create_app(self.store, turns, self.protocol.service_prefix, self.model.name,
                         self.protocol.frontends(), self.protocol.sse_heartbeat_s, session_ids=not g.allow_remote)
        self.server = GatewayServer(app, g.host, g.port, self.protocol.service_prefix, g.public_url, g.allow_remote)
        await self.server.start()
        log.info("gateway serving at %s, agents use %s%s (weights v%d)", self.server.bound_url,
                 self.server.base_url, "; credentials: RELAX_API_KEY only" if g.allow_remote else "",
                 self.engine.weight_version)

    def pipeline(self) -> Pipeline:
        cfg, store = self.config, self.store
        io_root = self.output_dir / "sessions"
        agents = AgentPools(self.agent, self.eval_agent)
        prepare = Prepare(store, agents, io_root, self.server.base_url, cfg.rollout.n_samples_per_prompt,
                          dict(cfg.rollout.chat_template_kwargs), cfg.seed, self.model.name)
        dump = RolloutDump(cfg.debug.save_rollout_data, self.output_dir)
        reward = Reward(store, self.credit, multi_context_missing(cfg, self.credit.several_contexts))
        runtime = Runtime(store, cfg.export.implicit, self.budgets)
        return Pipeline(DataSource(self.dataset, cfg.seed), prepare, runtime, reward, Transfer(store), dump,
                        cfg.rollout.batch_size)

    def loop(self) -> StepLoop:
        r, t = self.config.rollout, self.config.trainer.checkpoint_part
        steps = 0 if self.is_eval else r.num_steps  # job=eval: the loop's eval before the first step, no step
        self.strategy.bind(Binding(self.capacity.groups, self.engine, r.over_sampling_batch_size, steps))
        self.tracker.start(self.resolved)
        folder = Path(t.checkpoint_dir or self.output_dir / "checkpoints").expanduser()
        checkpoints = Checkpoints(folder, t.save_interval, t.resume, t.keep_checkpoints)
        pipeline = self.pipeline()
        loop = StepLoop(pipeline, self.strategy, self.engine, self.tracker, steps, self.trainer,
                        checkpoints, self.evaluator(pipeline))
        d = self.config.debug
        loop.recorder = StepRecorder(self.output_dir, d.replay_steps, self.model_path) if d.replay_bundle else None
        tracking = self.config.tracking
        loop.traces = TraceWriter(self.output_dir, True, tracking.otlp_endpoint) if tracking.traces else None
        return loop

    def evaluator(self, pipeline: Pipeline) -> Evaluator | None:
        """Eval of `eval.datasets` every `eval.interval` steps; None when eval is off. `job=eval`: once, with
        per-problem results."""
        if self.is_eval:
            return Evaluator(pipeline, self.eval_sets, interval=1, per_problem=True)
        interval = self.config.eval.interval
        if self.eval_sets and interval is None:
            log.warning("eval.datasets is set but eval.interval is null: eval is off")
        if not self.eval_sets or interval is None:
            return None
        return Evaluator(pipeline, self.eval_sets, interval)

    def slot_plan(self) -> SlotPlan:
        """Agent slots this run needs at its peak (`stages/capacity.py`)."""
        evals = tuple(EvalLoad(s.name, s.n_samples, s.concurrency) for s in self.eval_sets)
        separate = self.eval_agent is not None
        if self.is_eval:
            return SlotPlan(0, evals, False, separate)
        return SlotPlan(self.capacity.sessions, evals, self.strategy.retains_train_sessions, separate)

    async def check(self) -> dict[str, float]:
        """Findings of job=check: what would run, and anything that would stop it (raised); then `check.sessions`
        real sessions certified (`certify/check.py`): `check/certificate.json` and `.md`, the verdict's exit status
        as `check/exit_status`."""
        findings = {
            "model": str(self.model_path), "dataset_rows": len(self.dataset),
            "agent_command": self.agent.command, "agent_services": [s.name for s in self.services.specs],
            "resident_groups": self.capacity.groups,
            "resident_sessions": self.capacity.sessions, "max_context_len": self.context_len,
            "eval_datasets": {s.name: len(s.dataset) for s in self.eval_sets},
        }
        problems = _agent_problems(self.agent)
        for key, value in findings.items():
            log.info("check: %s = %s", key, value)
        for line in self.slot_plan().lines():
            log.info("check: slots: %s", line)
        for problem in problems:
            log.warning("check: problem: %s", problem)
        if problems:
            raise ValueError(problems[0])
        log.info("check: OK")
        stages, causes = [config_stage(findings, self.slot_plan().lines())], []
        if self.config.check.sessions > 0:
            found, causes = await self._certify_sessions()
            stages += found
        c = self.config
        setup = {"model": str(self.model_path), "agent": self.agent.command, "engine": c.engine._target_,
                 "reasoning_parser": c.protocol.reasoning_parser, "tool_call_parser": c.protocol.tool_call_parser,
                 "rollout.history": c.rollout.history, "export.implicit": c.export.implicit,
                 "check.sessions": c.check.sessions}
        cert = conclude(stages, causes, setup, self.output_dir)
        return {"check/problems": 0.0, "check/dataset_rows": float(len(self.dataset)),
                "check/resident_sessions": float(findings["resident_sessions"]),
                "check/required_slots": float(self.slot_plan().required), "check/exit_status": float(cert.exit_status)}

    async def _certify_sessions(self) -> tuple[list[Stage], list[Cause]]:
        """`check.sessions` sessions through the run's engine, gateway, services and pipeline (`certify/`)."""
        c = self.config
        try:
            await self._serve()
            await self.services.start()
        except Exception as error:  # noqa: BLE001 - an engine that cannot start is the check's verdict
            return [start_failed(error)], []
        template = ChatTemplate(self.engine.tokenizer, self.model.end_of_turn)
        runtime = RuntimeKeys(c.agent.timeout, type(self.strategy).__name__, c.credit.rm_path is not None)
        keys = CheckKeys(c.check.sessions, c.rollout.history, c.export.implicit, runtime)
        return await certify_sessions(self.pipeline(), template, self.protocol.parser(), keys)

    async def close(self) -> None:
        try:
            await self.strategy.close()
            if self.server is not None:
                await self.server.stop()
            await self.engine.close()
        finally:
            await self.services.stop()
            if self.trainer is not None:
                self.trainer.close()  # before Ray goes: ranks placed on Ray close their trainers first
            ray_runtime.shutdown()  # the agent runners and Ray itself when this run started it; no-op without Ray
            self.tracker.finish()


def eval_pool(train: AgentSpec, keys: dict[str, Any]) -> tuple[AgentSpec | None, int | None]:
    """`eval.agent`: eval sessions' own agent spec (the train spec with these keys replaced) and that pool's slots;
    (None, None) without one."""
    slots = keys.pop("slots", None)
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ValueError(f"eval.agent.slots={slots!r} must be a positive integer (the eval pool's agent slots)")
    if not keys and slots is None:
        return None, None
    return train.with_keys(keys, "eval.agent"), slots


def capacity_of(config: Config) -> Capacity:
    """The run's resident capacity, computed once (`stages/capacity.py`). `job=eval` holds no train sessions:
    unless `runtime.eval_concurrency` is set, its eval fills the engine's batch (`engine.max_batch_size`,
    as `T` sessions), else the train-derived default."""
    keys, ro = config.runtime.capacity_part, config.rollout
    if config.job == "eval" and keys.eval_concurrency is None:
        return Capacity(int(config.engine.max_batch_size), 1)
    return Capacity.resolve(keys.concurrency, ro.over_sampling_batch_size, ro.batch_size, ro.n_samples_per_prompt,
                            keys.eval_concurrency)


def eval_sets(config: Config, capacity: Capacity) -> list[EvalSet]:
    """Every `eval.datasets` entry, built with the train dataset's record (unshuffled, with the entry's own path
    and keys) and resolved: group size `n_samples_per_prompt` (default `eval.n_samples_per_prompt`) and
    groups in flight (`Capacity.eval_groups`). Errors name the entry (`eval.datasets[i]`)."""
    return [_eval_set(config, i, entry, capacity) for i, entry in enumerate(config.eval.datasets)]


def _eval_set(config: Config, index: int, entry: Any, capacity: Capacity) -> EvalSet:
    n_samples = entry.n_samples_per_prompt or config.eval.n_samples_per_prompt
    source = {"path": entry.path, "input_key": entry.input_key, "metadata_key": entry.metadata_key,
              "multimodal_keys": dict(entry.multimodal_keys)}
    try:
        dataset = build(with_source(config.dataset, source))
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"eval.datasets[{index}] name={entry.name!r}: {error}") from None
    return EvalSet(entry.name, dataset, n_samples, capacity.eval_groups(n_samples), dict(entry.metadata))


def _agent_problems(agent: Any) -> list[str]:
    problems = []
    if agent.cwd is not None and not Path(agent.cwd).is_dir():
        problems.append(f"agent.cwd={agent.cwd!r} is not a directory")
    if shutil.which("bash") is None:
        problems.append("bash is not on PATH; agents run with bash -c")
    return problems + service_problems(agent.services)


def _output_dir(cfg: DictConfig) -> Path:
    if cfg.get("output_dir"):
        return Path(cfg.output_dir).expanduser().resolve()
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def _one_sentence(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    named = isinstance(error, ValueError | FileNotFoundError)  # our own messages already name the key
    return text if named else f"{type(error).__name__}: {text}"
