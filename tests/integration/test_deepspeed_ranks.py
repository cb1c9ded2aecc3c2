"""trainer=deepspeed with trainer.num_ranks=2 on this CPU (gloo): real worker processes, the tiny model.

One optimizer step of 2 ranks on a fixed batch equals the 1-rank step (loss, every metric, grad norm,
parameters) for ZeRO stages 0, 2 and 3; the batch has an odd split and padding micro-batches, recomputed
reference logprobs, an entropy bonus, a reference-KL loss and whitened advantages, so the global
normalizers and the cross-rank reductions are all exercised. A 2-rank ZeRO-3 checkpoint (rank 0's Hugging
Face folder, every rank's DeepSpeed files) resumes exactly. A worker that raises or is killed fails the
call with `RankFailed` naming the rank and its log; closing, or rank 0 being SIGKILLed, leaves no worker.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relax_pipeline.credit.settings import AdvantageSettings
from relax_pipeline.forest.sample import Sample
from relax_pipeline.train.batching import BatchSettings
from relax_pipeline.train.losses import LossSettings
from relax_pipeline.train.optim import OptimSettings
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun
from tests.integration.test_trainer import assert_weights, make_samples

pytest.importorskip("deepspeed")
from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer  # noqa: E402
from relax_pipeline.train.rank_group import RankFailed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
LR = 5e-3
SETTINGS = {
    "batching": BatchSettings(micro_batch_size=2),
    "loss": LossSettings(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1),
    "optim": OptimSettings(lr=LR),
}
ADVANTAGES = AdvantageSettings(normalize_advantages=True)
BATCH = make_samples(9, seed=7, logprob=-3.0)
"""Rank 0 gets 5 samples (3 micro-batches), rank 1 gets 4 (2 micro-batches + 1 padding)."""
COMPARED = ("train/loss", "train/pg_loss", "train/entropy", "train/kl", "train/clipfrac", "train/ppo_kl",
            "train/grad_norm")


def one_step(tiny_path: Path, stage: int, ranks: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    t = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=stage, num_ranks=ranks, **SETTINGS),
                         TrainerRun(str(tiny_path), advantages=ADVANTAGES))
    try:
        metrics = t.train(BATCH)
        return metrics, t.engine_weights()
    finally:
        t.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_ranks_take_the_same_step_as_one(tiny_path: Path, stage: int) -> None:
    one, one_weights = one_step(tiny_path, stage, 1)
    two, two_weights = one_step(tiny_path, stage, 2)
    assert all(math.isfinite(one[k]) for k in COMPARED) and one["train/pg_loss"] != 0
    for key in COMPARED:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    # Adam's first step is lr*g/(|g|+eps), so where a gradient is near 0 float-order noise moves a weight by
    # a visible share of lr: weights are compared at lr/10 (a lost or doubled share moves them by ~lr).
    assert_weights(one_weights, two_weights, atol=LR / 10)


def test_two_rank_zero3_checkpoint_resumes_exactly(tiny_path: Path, tmp_path: Path) -> None:
    first, second = make_samples(5, seed=8), make_samples(5, seed=9)
    straight = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=3, num_ranks=2, **SETTINGS),
                                TrainerRun(str(tiny_path), advantages=ADVANTAGES, output_dir=str(tmp_path)))
    try:
        straight.train(first)
        straight.save(tmp_path / "ckpt", {"step": 1})
        straight.train(second)
        expected = straight.engine_weights()
    finally:
        straight.close()
    files = {p.name for p in (tmp_path / "ckpt").rglob("*")}
    assert {"model.safetensors", "config.json", "trainer_state.pt"} <= files
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= files
    assert (tmp_path / "trainer_ranks" / "rank1.log").is_file()
    resumed = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=3, num_ranks=2, **SETTINGS),
                               TrainerRun(str(tiny_path), advantages=ADVANTAGES))
    try:
        assert resumed.load(tmp_path / "ckpt") == {"step": 1} and resumed.version == 1
        resumed.train(second)
        assert_weights(expected, resumed.engine_weights(), atol=1e-7)
    finally:
        resumed.close()


def test_a_worker_that_raises_fails_the_call_naming_the_rank_and_its_log(tiny_path: Path, tmp_path: Path) -> None:
    bad = Sample((10, 11, 10**7, 12), 2, (1, 1), (-1.0, -1.0), advantage=1.0)  # token id beyond the vocabulary
    t = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=0, num_ranks=2, **SETTINGS),
                         TrainerRun(str(tiny_path), advantages=ADVANTAGES, output_dir=str(tmp_path)))
    worker = t.ranks.workers[0].process if t.ranks else None
    try:
        with pytest.raises(RankFailed) as failure:
            t.train([BATCH[0], bad])  # sample 1 goes to rank 1
    finally:
        t.close()
    log = tmp_path / "trainer_ranks" / "rank1.log"
    message = str(failure.value)
    assert "trainer rank 1" in message and "exited with code 1 during 'train'" in message
    assert f"its log: {log}" in message and "IndexError" in message and "IndexError" in log.read_text()
    assert worker is not None and worker.poll() is not None


def test_a_killed_worker_fails_the_next_call_and_close_leaves_no_process(tiny_path: Path) -> None:
    t = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=2, num_ranks=2, **SETTINGS),
                         TrainerRun(str(tiny_path), advantages=ADVANTAGES))
    try:
        assert t.ranks is not None
        worker = t.ranks.workers[0]
        worker.process.send_signal(signal.SIGKILL)
        with pytest.raises(RankFailed, match=f"trainer rank 1 \\(pid {worker.process.pid}\\) exited with code -9"):
            t.train(BATCH)
        with pytest.raises(RankFailed, match="trainer rank 1"):
            t.save(Path(worker.log).parent / "never", {})
    finally:
        t.close()
    assert worker.process.poll() == -9 and t.ranks is None


RANK0 = """
import sys
from pathlib import Path
from relax_pipeline.train.deepspeed_backend import DeepSpeedTrainer
from relax_pipeline.train.settings import DeepSpeedSettings, TrainerRun
t = DeepSpeedTrainer(DeepSpeedSettings(zero_stage=0, num_ranks=2), TrainerRun(sys.argv[1]))
print("worker", t.ranks.workers[0].process.pid, flush=True)
sys.stdin.read()
"""


def test_rank0_killed_takes_its_workers_with_it(tiny_path: Path) -> None:
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, str(tiny_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(rank0.stdout.readline, "")  # type: ignore[union-attr]
        worker = int(next(line for line in lines if line.startswith("worker ")).split()[1])
        assert alive(worker)
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 60
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(worker), f"worker {worker} outlived its rank 0"


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_rank_settings_are_checked_before_any_process_starts(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="trainer.num_ranks=0; use 1 or more"):
        DeepSpeedSettings(num_ranks=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="set trainer.num_ranks instead"):
        DeepSpeedTrainer(DeepSpeedSettings(num_ranks=2), TrainerRun(str(tiny_path), advantages=ADVANTAGES))
    assert os.environ["WORLD_SIZE"] == "2"
