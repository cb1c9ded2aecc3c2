"""The parts the recipes build from the records, each one function or one small class.

A recipe (`recipes/train.py`, ...) reads as its job: it makes a `Plan`, the run's cheap parts (the model folder,
the agent pools and their services, the dataset, the credit, the resident capacity, the eval sets, the runtime
strategy; nothing started), builds what it needs beyond it (`engine_of`, `trainer_of`, `tracker_of`), starts the
serving side (`serve`: the engine, the turn service, the session registry and the gateway), assembles the
pipeline (`pipeline_of`) and the step loop (`step_loop`), drives it under the run's stop signals (`drive`), and
lets `Teardown` close everything it started, in one order. A configured object is made one way: `build(record,
*live)` calls the class the record's `_target_` names with the record and the live collaborators.

Values derived from several keys are computed here once: the context limit, the resident capacity
(`capacity_of`), the eval sets (`eval_sets`), the eval pool (`eval_pool`) and the services a run starts
(`run_services`: the train pool's and the eval pool's own). Nothing here reads the composed config: only records.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from relax_pipeline.agent.launcher import AgentSpec
from relax_pipeline.agent.ray_executor import warm_up
from relax_pipeline.agent.services import Services, service_problems
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.config import Config, check_context_len, multi_context_missing
from relax_pipeline.data.dataset import DataSource
from relax_pipeline.data.settings import with_source
from relax_pipeline.engine.base import Engine
from relax_pipeline.engine.settings import EngineRun
from relax_pipeline.gateway.app import suite_app
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.infra import ray_runtime
from relax_pipeline.loop import Checkpoints, StepLoop
from relax_pipeline.models.spec import context_len
from relax_pipeline.scheduling.base import Binding, RuntimeStrategy
from relax_pipeline.stages.capacity import Capacity, EvalLoad, SlotPlan, check_slots
from relax_pipeline.stages.evaluate import EvalSet, Evaluator
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.stages.prepare import AgentPools, Prepare
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.runtime import Runtime
from relax_pipeline.stages.settings import EvalDatasetSettings
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.tracking.metrics_file import MetricsFile
from relax_pipeline.tracking.traces import TraceWriter
from relax_pipeline.train.base import Trainer
from relax_pipeline.train.settings import TrainerRun
from relax_pipeline.turn.records import SamplingDefaults
from relax_pipeline.turn.service import TurnService
from relax_pipeline.turn.sessions import ForestStore

log = logging.getLogger("relax_pipeline")


class Signals(Protocol):
    """The run's stop signals (`run.StopSignals`): what a recipe attaches its step loop to."""

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[int], None], kill: Callable[[], None]) -> None:
        """From now on a first signal calls `stop(signum)` on `loop`, a second one `kill()`."""

    def detach(self) -> None:
        """Signals no longer reach the step loop."""


@dataclass(frozen=True)
class Job:
    """What `run(cfg)` hands a recipe; connects the entry point to `relax_pipeline/recipes/`."""

    config: Config
    """The composed config as records, validated."""
    output_dir: Path | None = None
    """The run's output folder (run.log, config.yaml, dumps); None for the jobs that write none (view, replay)."""
    resolved: dict[str, Any] = field(default_factory=dict)
    """The resolved config as a mapping: what the tracker records."""
    signals: Signals | None = None
    """The run's stop signals; None: the run cannot be stopped by a signal (tests, the folderless jobs)."""

    @property
    def folder(self) -> Path:
        """`output_dir`, which every job that builds a run has."""
        assert self.output_dir is not None, f"job={self.config.job} runs without an output folder"
        return self.output_dir


def build(record: Any, *live: Any) -> Any:
    """The object a node configures: the class its record's `_target_` names, called with the record and the
    live collaborators the run hands it (the one way any configured object is made)."""
    return target(record)(record, *live)


def target(record: Any) -> type:
    """The class a record's `_target_` names."""
    module, _, name = record._target_.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass
class Plan:
    """A run's cheap parts, built from its records with nothing started (no engine, no agent, no port)."""

    config: Config
    output_dir: Path
    model: Any
    """The `model` node's spec (`models/spec.py`): its name and end-of-turn token."""
    model_path: Path
    """The model folder (`model.path`, or the built tiny model)."""
    context_len: int
    """`rollout.max_context_len`, else the model's own maximum."""
    agents: AgentPools
    eval_slots: int | None
    """`eval.agent.slots`: the eval pool's agent slots (None: unchecked, or no pool of its own)."""
    services: Services
    """The run's services (`run_services`), not started."""
    dataset: Any
    credit: Any
    capacity: Capacity
    eval_sets: list[EvalSet]
    strategy: RuntimeStrategy

    @classmethod
    def of(cls, config: Config, output_dir: Path) -> Plan:
        """The parts, each built from its record; the slot check refuses a run its agent slots cannot hold."""
        model = build(config.model, config.seed)
        model_path = model.resolve()
        limit = config.rollout.max_context_len or context_len(model_path)
        check_context_len(config.rollout.max_response_len, limit)
        agents, eval_slots = agent_pools(config)
        capacity = capacity_of(config)
        plan = cls(config, output_dir, model, model_path, limit, agents, eval_slots,
                   Services(run_services(agents), output_dir), build(config.dataset), build(config.credit), capacity,
                   eval_sets(config, capacity), build(config.runtime))
        check_slots(plan.slot_plan(), config.runtime.external_slots, eval_slots)
        return plan

    @property
    def is_eval(self) -> bool:
        return self.config.job == "eval"

    def slot_plan(self) -> SlotPlan:
        """Agent slots this run needs at its peak (`stages/capacity.py`)."""
        evals = tuple(EvalLoad(s.name, s.n_samples, s.concurrency) for s in self.eval_sets)
        separate = self.agents.eval is not None
        if self.is_eval:
            return SlotPlan(0, evals, False, separate)
        return SlotPlan(self.capacity.sessions, evals, self.strategy.retains_train_sessions, separate)


def agent_pools(config: Config) -> tuple[AgentPools, int | None]:
    """The train pool (`agent.*`, with the run's `sandbox.*` and `ray.*`) and the eval pool of `eval.agent`, with
    that pool's slots."""
    train = AgentSpec.of(config.agent, asdict(config.sandbox), asdict(config.ray))
    evals, slots = eval_pool(train, dict(config.eval.agent))
    return AgentPools(train, evals), slots


def eval_pool(train: AgentSpec, keys: dict[str, Any]) -> tuple[AgentSpec | None, int | None]:
    """`eval.agent`: eval sessions' own agent spec (the train spec with these keys replaced) and that pool's slots;
    (None, None) without one."""
    slots = keys.pop("slots", None)
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
        raise ValueError(f"eval.agent.slots={slots!r} must be a positive integer (the eval pool's agent slots)")
    if not keys and slots is None:
        return None, None
    return train.with_keys(keys, "eval.agent"), slots


def run_services(agents: AgentPools) -> dict[str, Any]:
    """The services a run starts: the train pool's (`agent.services`) and those the eval pool adds
    (`eval.agent.services`); one name with two different entries is refused, naming both keys."""
    services = dict(agents.train.services)
    for name, entry in (agents.eval.services if agents.eval is not None else {}).items():
        if name in services and services[name] != entry:
            raise ValueError(f"eval.agent.services.{name} differs from agent.services.{name}: a run starts one "
                             "service per name; give the eval pool's service another name")
        services[name] = entry
    return services


def agent_problems(agents: AgentPools, local_only: bool = False) -> list[str]:
    """What would stop the pools' agents from starting, one sentence each (`local_only`: only the pools whose
    agents run on this machine, `agent.executor=local`)."""
    problems = []
    pools = [("agent", agents.train)] + ([("eval.agent", agents.eval)] if agents.eval is not None else [])
    for key, spec in pools:
        if local_only and spec.executor != "local":
            continue
        if spec.cwd is not None and not Path(spec.cwd).is_dir():
            problems.append(f"{key}.cwd={spec.cwd!r} is not a directory: create it, or set {key}.cwd=null to run "
                            "agents in the run's working directory")
    if shutil.which("bash") is None:
        problems.append("bash is not on PATH; agents run with bash -c")
    return problems + service_problems(agents.train.services)


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


def _eval_set(config: Config, index: int, entry: EvalDatasetSettings, capacity: Capacity) -> EvalSet:
    n_samples = entry.n_samples_per_prompt or config.eval.n_samples_per_prompt
    try:
        dataset = build(with_source(config.dataset, entry.source()))
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"eval.datasets[{index}] name={entry.name!r}: {error}") from None
    return EvalSet(entry.name, dataset, n_samples, capacity.eval_groups(n_samples), dict(entry.metadata))


def engine_of(plan: Plan) -> Engine:
    """The `engine` node's class, not started, with what the run agreed on (model folder, seed, context limit)."""
    c = plan.config
    run = EngineRun(str(plan.model_path), c.seed, plan.context_len, plan.model.end_of_turn, str(plan.output_dir),
                    asdict(c.ray))
    return build(c.engine, run)


def trainer_of(plan: Plan) -> Trainer:
    """The `trainer` node's class, with what the run agreed on: seed, rollout temperature, credit keys."""
    c = plan.config
    run = TrainerRun(str(plan.model_path), c.seed, c.rollout.temperature, c.credit.advantages, str(plan.output_dir),
                     asdict(c.ray))
    return build(c.trainer, run)


def tracker_of(plan: Plan) -> MetricsFile:
    """The `tracking` node's tracker, every step's metrics also in `metrics.jsonl`."""
    return MetricsFile(build(plan.config.tracking, str(plan.output_dir)), plan.output_dir)


@dataclass
class Served:
    """The serving side of a run, started: the engine, the turn service, the session registry, the gateway."""

    engine: Engine
    template: ChatTemplate
    turns: TurnService
    store: ForestStore
    server: GatewayServer
    budgets: dict[str, SamplingDefaults]
    """The sampling of each session mode (`train`, `eval`): Runtime tells the pipeline's length cut by them."""


async def start_engine(engine: Engine, agents: AgentPools) -> None:
    """Start the engine; with `agent.executor=ray` the agents' nodes start while the model loads."""
    runners = asyncio.ensure_future(warm_up(agents.train)) if agents.train.executor == "ray" else None
    try:
        await engine.start()
    except BaseException:
        if runners is not None:
            runners.cancel()
        raise
    if runners is not None:
        await runners


async def serve(plan: Plan, engine: Engine, teardown: Teardown) -> Served:
    """Start the engine and the gateway in front of a turn service (`teardown` stops the gateway at the end)."""
    c = plan.config
    await start_engine(engine, plan.agents)
    template = ChatTemplate(engine.tokenizer, plan.model.end_of_turn)
    budgets = {"train": c.rollout.sampling(plan.context_len), "eval": c.eval.sampling(c.rollout, plan.context_len)}
    turns = TurnService(template, engine, c.protocol.parser(), budgets["train"], c.rollout.history, budgets["eval"])
    store = ForestStore(on_end=turns.end_session)  # an ended session's engine KV is released at once
    teardown.server = server = GatewayServer.of(_gateway_app(plan, store, turns), c.gateway, c.protocol.service_prefix)
    await server.start()
    log.info("gateway serving at %s, agents use %s%s (weights v%d)", server.bound_url, server.base_url,
             "; credentials: RELAX_API_KEY only" if c.gateway.allow_remote else "", engine.weight_version)
    return Served(engine, template, turns, store, server, budgets)


def _gateway_app(plan: Plan, store: ForestStore, turns: TurnService) -> Any:
    """The gateway's app: the protocol suite's front-ends; a loopback gateway also takes a session's id as its
    credential (docs/design.md §3.3)."""
    return suite_app(store, turns, plan.config.protocol, plan.model.name,
                     session_ids=not plan.config.gateway.allow_remote)


def pipeline_of(plan: Plan, served: Served) -> Pipeline:
    """The four stages of a group over the served session registry, the data source and the rollout dump."""
    c, store = plan.config, served.store
    prepare = Prepare(store, plan.agents, plan.output_dir / "sessions", served.server.base_url, c.rollout, c.seed,
                      plan.model.name)
    reward = Reward(store, plan.credit, multi_context_missing(c, plan.credit.several_contexts))
    runtime = Runtime(store, c.export, served.budgets)
    return Pipeline(DataSource(plan.dataset, c.seed), prepare, runtime, reward, Transfer(store),
                    c.debug.dump(plan.output_dir), c.rollout)


def evaluator_of(plan: Plan, pipeline: Pipeline) -> Evaluator | None:
    """Eval of `eval.datasets` every `eval.interval` steps; None when eval is off. `job=eval`: once, with
    per-problem results."""
    if plan.is_eval:
        return Evaluator(pipeline, plan.eval_sets, interval=1, per_problem=True)
    interval = plan.config.eval.interval
    if plan.eval_sets and interval is None:
        log.warning("eval.datasets is set but eval.interval is null: eval is off")
    if not plan.eval_sets or interval is None:
        return None
    return Evaluator(pipeline, plan.eval_sets, interval)


def step_loop(job: Job, plan: Plan, served: Served, tracker: MetricsFile, trainer: Trainer | None,
              steps: int) -> StepLoop:
    """The step loop of `steps` steps over a new pipeline, the strategy bound to it and the tracker started."""
    c = plan.config
    plan.strategy.bind(Binding(plan.capacity.groups, served.engine, c.rollout.over_sampling_batch_size, steps))
    tracker.start(job.resolved)
    pipeline = pipeline_of(plan, served)
    traces = TraceWriter(plan.output_dir, True, c.tracking.otlp_endpoint) if c.tracking.traces else None
    checkpoints = Checkpoints.of(c.trainer.checkpoint_part, plan.output_dir)
    return StepLoop(pipeline, plan.strategy, served.engine, tracker, steps, trainer, checkpoints,
                    evaluator_of(plan, pipeline), recorder=c.debug.recorder(plan.output_dir, plan.model_path),
                    traces=traces)


async def assemble(job: Job, plan: Plan, teardown: Teardown, trainer: Trainer | None, steps: int) -> StepLoop:
    """What the step loop of `job=train`, `rollout` and `eval` runs on, started: the tracker, the engine behind the
    gateway, the services; then the loop over them (`teardown` closes each at the end)."""
    teardown.trainer = trainer
    teardown.tracker = tracker = tracker_of(plan)
    teardown.engine = engine = engine_of(plan)
    served = await serve(plan, engine, teardown)
    await plan.services.start()
    return step_loop(job, plan, served, tracker, trainer, steps)


def refuse(problems: list[str]) -> None:
    """Stop the run on the first problem (its one sentence names the key, the value and the fix)."""
    if problems:
        raise ValueError(problems[0])


async def drive(loop: StepLoop, job: Job, services: Services) -> dict[str, float]:
    """Run the loop with the run's signals attached: the first stops it, the second kills every agent."""
    if job.signals is None:
        return await loop.run()
    job.signals.attach(asyncio.get_running_loop(), loop.request_stop,
                       lambda: (loop.pipeline.kill_agents(), services.kill()))
    try:
        return await loop.run()
    finally:
        job.signals.detach()


class Teardown:
    """Everything a run started, closed at its end in one order: the strategy's groups, the gateway, the engine,
    the services, the trainer (before Ray goes: ranks placed on Ray close their trainers first), Ray, the
    tracker. A part not built is skipped; a failure closing one still closes the rest."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.server: GatewayServer | None = None
        self.engine: Engine | None = None
        self.trainer: Trainer | None = None
        self.tracker: MetricsFile | None = None

    async def __aenter__(self) -> Teardown:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            await self.plan.strategy.close()
            if self.server is not None:
                await self.server.stop()
            if self.engine is not None:
                await self.engine.close()
        finally:
            await self.plan.services.stop()
            if self.trainer is not None:
                self.trainer.close()
            ray_runtime.shutdown()  # the agent runners and Ray itself when this run started it; no-op without Ray
            if self.tracker is not None:
                self.tracker.finish()
