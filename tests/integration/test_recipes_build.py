"""Each job's recipe composes and builds its parts from every `experiment=` preset, running nothing heavy.

For every preset of `conf/experiment/` and every job: the config composes, its records are made and validated,
and the parts that job's recipe builds are built as the recipe builds them (`recipes/parts.py`): the plan (model
folder, agent pools and services, dataset, credit, capacity, eval sets, strategy), the engine (not started), the
tracker, a gateway server (not bound), the pipeline and the step loop; the trainer's and the viewer's servers are
bound to their signatures instead of being built or served. `job=check` logs its findings; `job=replay` makes its
records from a bundle folder holding the preset's own config; `job=view` checks a run folder and builds the
viewer's app. No engine starts, no agent runs, no port is bound. Presets whose model is built from a package
(`model=smollm2`) get `model.path` of the tiny model (the conversion takes a minute; it is not what this checks).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from relax_pipeline.config import CONF_DIR, Config, quote_placeholders, records, register, validate
from relax_pipeline.gateway.server import GatewayServer
from relax_pipeline.loop import StepLoop
from relax_pipeline.recipes import check, parts
from relax_pipeline.recipes.parts import Job, Plan, Served
from relax_pipeline.replay import format as fmt
from relax_pipeline.replay.job import replay_run
from relax_pipeline.train.settings import TrainerRun
from relax_pipeline.turn.sessions import ForestStore
from relax_pipeline.view.app import create_app as viewer_app
from relax_pipeline.view.server import serve_view

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
STEP_JOBS = ("train", "rollout", "eval")
BUILT_LOCALLY = ("tiny", "tiny_vl")


def _compose(preset: str, job: str, tmp_path: Path, tiny_path: Path, *extra: str) -> DictConfig:
    register()
    overrides = [f"experiment={preset}", f"job={job}", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
                 *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders(overrides))
        if cfg.model.name not in BUILT_LOCALLY and cfg.model.path is None:
            cfg = compose("config", overrides=quote_placeholders([*overrides, f"model.path={tiny_path}"]))
        if job == "eval":
            cfg = compose("config", overrides=quote_placeholders([*overrides, *_eval_keys(cfg)]))
    return cfg


def _eval_keys(cfg: DictConfig) -> list[str]:
    """What `job=eval` on a train preset needs: an eval set (the preset's own data when it has none) and, on an
    external platform of few slots, eval groups that fit them (job=eval otherwise fills the engine's batch)."""
    keys = [f"model.path={cfg.model.path}"] if cfg.model.path else []
    if not cfg.eval.datasets:
        keys.append(f"eval.datasets=[{{name:probe,path:'{cfg.dataset.path}'}}]")
    if cfg.runtime.external_slots is not None and cfg.runtime.eval_concurrency is None:
        keys.append(f"runtime.eval_concurrency={cfg.runtime.external_slots}")
    return keys


def _config(cfg: DictConfig) -> Config:
    config = records(cfg)
    validate(config)
    return config


def test_there_are_presets() -> None:
    assert "smoke_cpu" in PRESETS and len(PRESETS) >= 5


@pytest.mark.parametrize("job", STEP_JOBS)
@pytest.mark.parametrize("preset", PRESETS)
def test_a_step_job_builds_its_parts(preset: str, job: str, tmp_path: Path, tiny_path: Path) -> None:
    cfg = _compose(preset, job, tmp_path, tiny_path)
    config = _config(cfg)
    plan = Plan.of(config, tmp_path)
    assert plan.model_path.is_dir() and plan.context_len > config.rollout.max_response_len
    assert len(plan.dataset) > 0 and plan.capacity.groups >= 1
    assert not parts.agent_problems(plan.agents, local_only=True), "the preset's agent folders exist"
    assert [s.name for s in plan.eval_sets] == [e.name for e in config.eval.datasets]
    engine = parts.engine_of(plan)  # built, not started
    assert type(engine) is parts.target(config.engine)
    if job == "train":
        run = TrainerRun(str(plan.model_path), config.seed, config.rollout.temperature, config.credit.advantages,
                         str(tmp_path), {})
        inspect.signature(parts.target(config.trainer)).bind(config.trainer, run)  # bound, not built
    loop = asyncio.run(_loop(cfg, config, plan, engine, tmp_path, job))
    assert loop.num_steps == (0 if job == "eval" else config.rollout.num_steps)
    evaluates = job == "eval" or (bool(plan.eval_sets) and config.eval.interval is not None)
    assert (loop.evaluator is not None) == evaluates
    assert loop.pipeline.batch_size == config.rollout.batch_size
    assert loop.pipeline.prepare.n_samples == config.rollout.n_samples_per_prompt


async def _loop(cfg: DictConfig, config: Config, plan: Plan, engine: object, tmp_path: Path, job: str) -> StepLoop:
    """The step loop as the recipe assembles it, over a gateway server that is made but never started."""
    server = GatewayServer.of(None, config.gateway, config.protocol.service_prefix)  # type: ignore[arg-type]
    budgets = {"train": config.rollout.sampling(plan.context_len),
               "eval": config.eval.sampling(config.rollout, plan.context_len)}
    served = Served(engine, None, None, ForestStore(), server, budgets)  # type: ignore[arg-type]
    tracker = parts.tracker_of(plan)
    job_record = Job(config, tmp_path, OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    steps = 0 if job == "eval" else config.rollout.num_steps
    try:
        return parts.step_loop(job_record, plan, served, tracker, None, steps)
    finally:
        await plan.strategy.close()
        tracker.finish()


@pytest.mark.parametrize("preset", PRESETS)
def test_check_builds_its_findings(preset: str, tmp_path: Path, tiny_path: Path) -> None:
    config = _config(_compose(preset, "check", tmp_path, tiny_path))
    plan = Plan.of(config, tmp_path)
    parts.engine_of(plan)
    found = check.findings(plan)
    assert found["resident_sessions"] == plan.capacity.sessions and found["dataset_rows"] == len(plan.dataset)
    assert found["agent_services"] == list(parts.run_services(plan.agents))
    assert check.setup(plan)["check.sessions"] == config.check.sessions
    check.report(plan, found)  # no problem in a shipped preset


@pytest.mark.parametrize("preset", PRESETS)
def test_replay_makes_its_records_from_a_bundle_of_the_preset(preset: str, tmp_path: Path, tiny_path: Path) -> None:
    recorded = _compose(preset, "train", tmp_path / "run", tiny_path)
    bundle = tmp_path / "run" / "replay" / "step_0"
    bundle.mkdir(parents=True)
    (bundle / fmt.MANIFEST).write_text(json.dumps({"format_version": fmt.FORMAT_VERSION, "step": 0}))
    (bundle / fmt.CONFIG).write_text(OmegaConf.to_yaml(recorded, resolve=True))
    config = _config(_compose(preset, "replay", tmp_path, tiny_path, f"replay.bundle={bundle}"))
    run = replay_run(config.replay, config.credit)
    assert run.bundle == bundle
    assert run.credit == records(recorded).credit, "the preset's credit keys laid over the bundle's: the same node"
    assert run.train.trainer.device == "cpu" and run.train.temperature == recorded.rollout.temperature


@pytest.mark.parametrize("preset", PRESETS)
def test_view_checks_its_folder_and_builds_the_viewer(preset: str, tmp_path: Path, tiny_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(_compose(preset, "train", folder, tiny_path)))
    config = _config(_compose(preset, "view", tmp_path, tiny_path, f"view.dir={folder}"))
    v = config.view
    assert v.folder(config.output_dir) == folder
    viewer_app(folder, v.tokenizer)
    inspect.signature(serve_view).bind(folder, v.host, v.port, v.tokenizer)
