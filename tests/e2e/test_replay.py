"""Replay bundles end to end: a recorded train step of the tiny model replays its credit and loss on the CPU.

A real run (embedded engine, gateway, digits agents, torch trainer) writes a bundle per step with
`debug.replay_bundle=true`; `job=replay` then re-scores the step's groups and re-trains it from the checkpoint
before it: advantages and loss bit-exact, the gradient norm within `GRAD_NORM_RTOL`. An edited advantage function
on the replay command shows its diff; a bundle of another format version is refused naming both versions; a
bundle written under `runtime=partial` (a generation aborted in step 0 and resumed in step 1) replays, and so do the
bundles of a `runtime=fully_async` run, whose batches mix weight versions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from test_runtime_modes import _async_cfg, _partial_cfg
from test_train_e2e import train_config

from relax_pipeline.config import CONF_DIR, register
from relax_pipeline.replay import format as fmt
from relax_pipeline.replay.format import BundleVersionError, read_bundle
from relax_pipeline.run import run

EDITED = '''
def alternate(metadata_by_slot):
    """+1 for even slots, -1 for odd ones: an edit whose diff is easy to see."""
    return [{name: (1.0 if i % 2 == 0 else -1.0) for name in slot} for i, slot in enumerate(metadata_by_slot)]


def by_prompt(samples):
    """Keep a group by its prompt's checksum: some groups filtered, the same ones on every call."""
    import json
    import zlib

    return zlib.crc32(json.dumps(samples[0]["prompt"], sort_keys=True).encode()) % 2 == 0
'''


def replay_config(bundle: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["job=replay", f"replay.bundle={bundle}", *overrides])


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Path:
    """A two-step train run with a checkpoint and a replay bundle after every step."""
    out = tmp_path_factory.mktemp("recorded")
    run(train_config(out, tiny_path, "rollout.num_steps=2", "trainer.save_interval=1", "debug.replay_bundle=true"))
    return out


def test_a_bundle_holds_the_step_and_a_plain_reader_loads_it(recorded: Path) -> None:
    bundle = read_bundle(recorded / "replay" / "step_1")
    manifest = bundle["manifest"]
    assert manifest["format_version"] == fmt.FORMAT_VERSION and manifest["step"] == 1
    assert manifest["checkpoint_before"]["path"].endswith("step_1")
    assert manifest["checkpoint_after"]["path"].endswith("step_2")
    assert len(manifest["checkpoint_before"]["sha256"]["model.safetensors"]) == 64
    assert bundle["rows"] == [json.loads(line) for line in (recorded / "dump" / "r_1.jsonl").read_text().splitlines()]
    credited = [c for g in bundle["credit"] for c in g["contexts"] if c["advantage"] is not None]
    assert [b["advantage"] for b in bundle["batch"]] == [c["advantage"] for c in credited]
    assert len(bundle["batch"]) == bundle["metrics"]["train/samples"]
    assert "credit:" in bundle["config"] and "train/loss" in bundle["metrics"]
    assert read_bundle(recorded / "replay" / "step_0")["manifest"]["checkpoint_before"] is not None, "the model"


@pytest.mark.parametrize("step", [0, 1])
def test_a_recorded_step_replays_its_advantages_and_loss_exactly(recorded: Path, step: int,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    metrics = run(replay_config(recorded / "replay" / f"step_{step}"))
    printed = capsys.readouterr().out
    assert metrics["replay/credit_identical"] == 1.0 and metrics["replay/batch_identical"] == 1.0, printed
    assert metrics["replay/loss_identical"] == 1.0, printed
    assert metrics["replay/grad_norm_within_tolerance"] == 1.0, printed
    assert "credit: " in printed and "identical (bit-exact)" in printed and "grad_norm (recorded credit)" in printed


def test_an_edited_advantage_function_shows_its_diff(recorded: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_credit.py").write_text(EDITED)
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = run(replay_config(recorded / "replay" / "step_1", "credit=custom_advantage",
                                "credit.advantage_path=my_credit.alternate"))
    printed = capsys.readouterr().out
    assert metrics["replay/credit_identical"] == 0.0 and metrics["replay/batch_identical"] == 0.0
    assert metrics["replay/loss_identical"] == 1.0, "the recorded credit still replays exactly"
    assert metrics["replay/edited_loss"] != metrics["replay/loss"]
    assert "advantage recorded -> replayed" in printed and "+1.000000  " in printed and "  *" in printed
    assert "loss with the edited credit" in printed


def test_a_bundle_of_another_format_version_is_refused(recorded: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "step_1"
    shutil.copytree(recorded / "replay" / "step_1", bundle)
    manifest = json.loads((bundle / fmt.MANIFEST).read_text())
    (bundle / fmt.MANIFEST).write_text(json.dumps({**manifest, "format_version": 999}))
    with pytest.raises(BundleVersionError, match=f"format_version=999.*reads format_version={fmt.FORMAT_VERSION}"):
        run(replay_config(bundle))


def test_a_bundle_written_under_partial_rollout_replays(tmp_path: Path, tiny_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _partial_cfg(tmp_path, tiny_path, max_aborted=2)
    cfg.job, cfg.debug.replay_bundle, cfg.trainer.save_interval = "train", True, 1
    run(cfg)
    bundle = read_bundle(tmp_path / "replay" / "step_1")
    resumed = [r for r in bundle["rows"] if r.get("abort_count")]
    assert resumed and resumed[0]["group_id"].startswith("g0-"), "the aborted generation finished in step 1"
    assert bundle["batch"] and bundle["manifest"]["checkpoint_before"]["path"].endswith("step_1")
    metrics = run(replay_config(tmp_path / "replay" / "step_1"))
    printed = capsys.readouterr().out
    assert metrics["replay/credit_identical"] == 1.0 and metrics["replay/batch_identical"] == 1.0, printed
    assert metrics["replay/loss_identical"] == 1.0 and metrics["replay/grad_norm_within_tolerance"] == 1.0, printed


def test_a_deepspeed_step_replays_on_the_torch_trainer(tmp_path: Path, tiny_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """trainer=deepspeed (one rank, ZeRO 2 on gloo): the replay trains one torch process from the checkpoint's
    weights; the first global batch needs no optimizer state, so loss and grad norm come out within tolerance."""
    pytest.importorskip("deepspeed")
    run(train_config(tmp_path, tiny_path, "trainer=deepspeed", "trainer.zero_stage=2", "rollout.num_steps=2",
                     "trainer.save_interval=1", "debug.replay_bundle=true"))
    metrics = run(replay_config(tmp_path / "replay" / "step_1"))
    printed = capsys.readouterr().out
    assert metrics["replay/credit_identical"] == 1.0 and metrics["replay/batch_identical"] == 1.0, printed
    assert metrics["replay/loss_within_tolerance"] == 1.0, printed
    assert metrics["replay/grad_norm_within_tolerance"] == 1.0, printed


def test_fully_async_bundles_replay_with_their_mixed_weight_versions(tmp_path: Path, tiny_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run(_async_cfg(tmp_path, tiny_path, "runtime.max_staleness=null", "trainer.save_interval=1",
                   "debug.replay_bundle=true"))
    bundles = sorted((tmp_path / "replay").glob("step_*"))
    assert [b.name for b in bundles] == ["step_0", "step_1", "step_2"]
    mixed = [b for b in bundles if any(len(set(r["weight_versions"])) > 1 for r in read_bundle(b)["batch"])]
    assert mixed, "a session preempted by a weight update trains tokens of two versions"
    for bundle in bundles:
        metrics = run(replay_config(bundle))
        printed = capsys.readouterr().out
        assert metrics["replay/credit_identical"] == 1.0 and metrics["replay/batch_identical"] == 1.0, printed
        assert metrics["replay/loss_identical"] == 1.0, printed
        assert metrics["replay/grad_norm_within_tolerance"] == 1.0, printed


def test_a_step_with_filtered_groups_replays_their_filter(tmp_path: Path, tiny_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A filtered group's rows carry no tokens: its contexts' samples are in credit.jsonl, and the filter replays."""
    (tmp_path / "my_credit.py").write_text(EDITED)
    monkeypatch.syspath_prepend(str(tmp_path))
    run(train_config(tmp_path / "run", tiny_path, "rollout.num_steps=1", "rollout.batch_size=4",
                     "credit.filter_path=my_credit.by_prompt", "debug.replay_bundle=true"))
    bundle = read_bundle(tmp_path / "run" / "replay" / "step_0")
    filtered = [g for g in bundle["credit"] if g["filtered"]]
    assert filtered and len(filtered) < len(bundle["credit"]), "some groups filtered, some kept"
    assert all(c["row"] is None and c["sample"]["tokens"] for g in filtered for c in g["contexts"])
    metrics = run(replay_config(tmp_path / "run" / "replay" / "step_0"))
    printed = capsys.readouterr().out
    assert metrics["replay/credit_identical"] == 1.0 and metrics["replay/batch_identical"] == 1.0, printed
    assert metrics["replay/loss_identical"] == 1.0, printed
