"""Config: every group option composes, binds to its `_target_`'s signature and instantiates; jobs refuse
bad setups at start naming the key; the CLI's exit status and last log line; a two-value sweep.

Golden file: `tests/golden/default_config.yaml`, regenerated with
`python -m relax_pipeline --cfg job > tests/golden/default_config.yaml`.
"""

from __future__ import annotations

import inspect
import itertools
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf

from relax_pipeline.config import (
    CONF_DIR,
    FLAT_TRAINER_KEYS,
    TRAINER_NODES,
    TrainerConfig,
    build,
    build_trainer,
    register,
    runtime_node,
    trainer_context,
    trainer_node,
)
from relax_pipeline.run import run

CONF = CONF_DIR
GROUPS = ("protocol", "runtime", "credit", "engine", "trainer", "model", "dataset", "agent", "tracking")
BUILD_ARGS = {
    "engine": {"model_path": "unused", "seed": 0, "max_context_len": 128},
    "model": {"seed": 0},
    "tracking": {"output_dir": "unused"},
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_default_config_matches_the_golden_file() -> None:
    golden = (Path(__file__).parent.parent / "golden" / "default_config.yaml").read_text()
    assert OmegaConf.to_yaml(composed()) == golden


def test_a_misspelt_key_fails_at_compose_time() -> None:
    with pytest.raises(ConfigCompositionException):
        composed("rollout.batch_sise=3")


NODES = {"trainer": trainer_node, "runtime": runtime_node}
"""Groups whose node is narrowed before it is built (aliases and capacity keys are read elsewhere)."""


@pytest.mark.parametrize(
    "protocol, runtime, credit",
    list(itertools.product(options("protocol"), options("runtime"), options("credit"))),
)
def test_every_combination_binds_every_target(protocol: str, runtime: str, credit: str) -> None:
    cfg = composed(f"protocol={protocol}", f"runtime={runtime}", f"credit={credit}")
    for group in GROUPS:
        node = OmegaConf.to_container(NODES.get(group, lambda n: n)(cfg[group]), resolve=True)
        target = get_class(node.pop("_target_"))
        assert target.__module__.startswith("relax_pipeline."), f"{group} must target our own class"
        extra = {"model_path": "unused", **trainer_context(cfg)} if group == "trainer" else BUILD_ARGS.get(group, {})
        inspect.signature(target).bind(**node, **extra)


@pytest.mark.parametrize("trainer", options("trainer"))
def test_trainer_nodes_are_the_records_their_class_takes(trainer: str) -> None:
    cfg = composed(f"trainer={trainer}")
    hints = typing.get_type_hints(get_class(cfg.trainer._target_).__init__)
    for name, record in TRAINER_NODES.items():
        assert OmegaConf.get_type(cfg.trainer[name]) is record and record in typing.get_args(hints[name])


def test_every_nested_trainer_key_keeps_a_flat_alias_for_one_release() -> None:
    declared = {f.name: f.default for f in fields(TrainerConfig)}
    nested = {f"{name}.{f.name}" for name, record in TRAINER_NODES.items() for f in fields(record)}
    assert set(FLAT_TRAINER_KEYS.values()) == nested
    assert all(declared[flat] is None for flat in FLAT_TRAINER_KEYS)


def test_flat_trainer_aliases_take_effect_and_log_a_deprecation(tmp_path: Path, tiny_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    cfg = composed("job=check", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
                   "trainer.lr=5e-3", "trainer.micro_batch_size=2", "trainer.loss.entropy_coef=0.01")
    run(cfg)
    log = (tmp_path / "run.log").read_text()
    for flat, nested in (("lr", "optim.lr"), ("micro_batch_size", "batching.micro_batch_size")):
        assert log.count(f"trainer.{flat} is deprecated") == 1 and f"use trainer.{nested}" in log
    assert "trainer.entropy_coef is deprecated" not in log
    caplog.clear()
    trainer = build_trainer(cfg, model_path=str(tiny_path))
    assert trainer.optimizer.param_groups[0]["lr"] == 5e-3 and trainer.settings.batching.micro_batch_size == 2
    assert trainer.settings.loss.entropy_coef == 0.01 and trainer.settings.loss.eps_clip_high == 0.28
    assert "deprecated" not in caplog.text, "the aliases were moved once, at validate"


def test_a_trainer_mistake_fails_at_build_naming_the_nested_key(tiny_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer\.loss\.loss_reduction='sum'; choose one of"):
        build_trainer(composed("trainer.loss.loss_reduction=sum"), model_path=str(tiny_path))


CPU_SAFE = [(g, o) for g in GROUPS if g not in ("engine", "trainer") for o in options(g)]


@pytest.mark.parametrize("group, option", CPU_SAFE)
def test_cpu_safe_groups_instantiate(group: str, option: str, tmp_path: Path) -> None:
    cfg = composed(f"{group}={option}")
    args = {"output_dir": str(tmp_path)} if group == "tracking" else BUILD_ARGS.get(group, {})
    built = build(NODES.get(group, lambda n: n)(cfg[group]), **args)
    assert type(built).__name__ == cfg[group]._target_.rsplit(".", 1)[1]


def test_experiment_smoke_cpu_composes_to_a_rollout() -> None:
    cfg = composed("experiment=smoke_cpu")
    assert cfg.job == "rollout" and cfg.rollout.num_steps == 1


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("job=nap", "job='nap' is not a job"),
        ("rollout.batch_size=0", "rollout.batch_size must be positive"),
        ("rollout.max_response_len=4096", "rollout.max_response_len=4096 must be smaller than rollout.max_context_len"),
        ("+agent.env.RELAX_X=x", "the RELAX_ prefix is reserved"),
        ("protocol.tool_call_parser=nope", "protocol.tool_call_parser='nope' is not built in"),
        ("dataset.path=/nonexistent.jsonl", "dataset.path='/nonexistent.jsonl' does not exist"),
        ("agent.cwd=/nonexistent", "agent.cwd='/nonexistent' is not a directory"),
        ("eval.interval=2", "eval.interval=2 needs at least one eval dataset"),
        ("eval.datasets=[{name:a/b,path:x.jsonl}]", "eval.datasets[0].name='a/b' must be unique"),
        ("eval.datasets=[{name:a,path:/nonexistent.jsonl}]", "eval.datasets[0] name='a': dataset.path="),
    ],
)
def test_bad_setups_fail_at_start_naming_the_key(tmp_path: Path, tiny_path: Path, override: str, fragment: str
                                                 ) -> None:
    cfg = composed("job=check", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", override)
    with pytest.raises(Exception, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        run(cfg)
    assert fragment.split("=")[0].split(".")[0] in (tmp_path / "run.log").read_text().splitlines()[-1]


@pytest.mark.parametrize(
    "overrides, keys",
    [
        ((), "needs credit=custom_advantage and trainer.batching.use_dynamic_batch_size=true;"),
        (("credit=custom_advantage",), "needs trainer.batching.use_dynamic_batch_size=true;"),
        (("trainer.batching.use_dynamic_batch_size=true",), "needs credit=custom_advantage;"),
    ],
)
@pytest.mark.parametrize("job", ["check", "train"])
def test_a_multi_context_setup_without_custom_advantage_or_dynamic_batching_refuses_to_start(
        tmp_path: Path, tiny_path: Path, overrides: tuple[str, ...], keys: str, job: str) -> None:
    cfg = composed(f"job={job}", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
                   "agent.multi_context=true", *overrides)
    with pytest.raises(ValueError, match=f"agent.multi_context=true .* {keys}"):
        run(cfg)
    assert f"run failed: agent.multi_context=true (sessions export several contexts) {keys}" in (
        tmp_path / "run.log").read_text().splitlines()[-1]


def test_a_complete_multi_context_setup_passes_the_check(tmp_path: Path, tiny_path: Path) -> None:
    cfg = composed("job=check", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}",
                   "agent.multi_context=true", "credit=custom_advantage",
                   "trainer.batching.use_dynamic_batch_size=true")
    assert run(cfg)["check/problems"] == 0


def test_check_job_reports_findings(tmp_path: Path, tiny_path: Path) -> None:
    metrics = run(composed("job=check", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}"))
    assert metrics["check/problems"] == 0 and metrics["check/dataset_rows"] == 64
    assert "check: OK" in (tmp_path / "run.log").read_text()


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax_pipeline", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=240)


def test_cli_exit_status_and_last_log_line(tmp_path: Path, tiny_path: Path) -> None:
    cache = f"model.cache_dir={tiny_path.parent}"
    ok = cli("job=check", cache, f"hydra.run.dir={tmp_path}/ok", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    failed = cli(cache, "dataset.path=/nonexistent.jsonl", f"hydra.run.dir={tmp_path}/bad", cwd=tmp_path)
    assert failed.returncode != 0
    last = (tmp_path / "bad" / "run.log").read_text().strip().splitlines()[-1]
    assert "run failed: dataset.path='/nonexistent.jsonl' does not exist" in last


def test_multirun_sweep_runs_each_job_in_its_own_folder(tmp_path: Path, tiny_path: Path) -> None:
    result = cli("-m", "job=rollout", "experiment=smoke_cpu", "seed=0,1", f"model.cache_dir={tiny_path.parent}",
                 "debug.save_rollout_data=r_{rollout_id}.jsonl", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "r_0.jsonl").read_text().strip()
        assert "accounting_end" in (tmp_path / job / "run.log").read_text()


def test_a_runtime_key_the_mode_does_not_use_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"runtime.max_staleness=3 is not used by SyncRuntime"):
        build(runtime_node(composed("runtime=sync", "runtime.max_staleness=3").runtime))
    strategy = build(runtime_node(composed("runtime=fully_async", "runtime.concurrency=5").runtime))
    assert strategy.max_staleness == 2 and not hasattr(strategy, "concurrency")
