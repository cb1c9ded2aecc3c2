"""Config: every group option composes into its records and builds; jobs refuse bad setups at start naming
the key; the CLI's exit status and last log line; a two-value sweep.

Golden file: `tests/golden/default_config.yaml`, regenerated with
`python -m relax_pipeline --cfg job > tests/golden/default_config.yaml`.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from relax_pipeline.config import CONF_DIR, Config, records, register
from relax_pipeline.recipes.parts import build
from relax_pipeline.run import run
from relax_pipeline.scheduling.settings import RuntimeSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerSettings

CONF = CONF_DIR
LIVE = {"model": (0,), "tracking": ("unused",)}
"""What run.py hands each CPU-safe group's class besides its record."""


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


@pytest.mark.parametrize(
    "protocol, runtime, credit",
    list(itertools.product(options("protocol"), options("runtime"), options("credit"))),
)
def test_every_combination_builds_its_records_and_strategy(protocol: str, runtime: str, credit: str) -> None:
    config = records(composed(f"protocol={protocol}", f"runtime={runtime}", f"credit={credit}"))
    assert isinstance(config, Config) and isinstance(config.runtime, RuntimeSettings)
    strategy = build(config.runtime)
    assert type(strategy).__module__.startswith("relax_pipeline.scheduling.")


@pytest.mark.parametrize("trainer, record", [("torch", TrainerSettings), ("deepspeed", DeepSpeedSettings)])
def test_the_trainer_node_is_its_backend_s_record(trainer: str, record: type) -> None:
    assert type(records(composed(f"trainer={trainer}")).trainer) is record


@pytest.mark.parametrize("override", ["trainer.lr=5e-3", "trainer.micro_batch_size=2", "trainer.zero_stage=2",
                                      "trainer.num_ranks=2"])
def test_removed_aliases_and_deepspeed_keys_on_torch_fail_at_compose_naming_the_key(override: str) -> None:
    with pytest.raises(ConfigCompositionException) as error:
        composed(override)
    assert override.split("=")[0] in str(error.value) + str(error.value.__cause__)


def test_a_trainer_mistake_fails_naming_the_nested_key() -> None:
    with pytest.raises(ValueError, match=r"trainer\.loss\.loss_reduction='sum'; choose one of"):
        records(composed("trainer.loss.loss_reduction=sum"))


CPU_SAFE = [(g, o) for g in ("credit", "dataset", "model", "tracking", "runtime") for o in options(g)]


@pytest.mark.parametrize("group, option", CPU_SAFE)
def test_cpu_safe_groups_instantiate(group: str, option: str, tmp_path: Path) -> None:
    record = getattr(records(composed(f"{group}={option}")), group)
    live = (str(tmp_path),) if group == "tracking" else LIVE.get(group, ())
    built = build(record, *live)
    assert type(built).__name__ == record._target_.rsplit(".", 1)[1]


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
        build(records(composed("runtime=sync", "runtime.max_staleness=3")).runtime)
    strategy = build(records(composed("runtime=fully_async", "runtime.concurrency=5")).runtime)
    assert strategy.max_staleness == 2 and not hasattr(strategy, "concurrency")
