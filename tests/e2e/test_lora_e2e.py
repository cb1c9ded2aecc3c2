"""`trainer.lora` end to end on the tiny model: a train run syncs only its adapter, stamps every token with its
version, checkpoints PEFT folders that `job=eval model.path=...` serves and `job=replay` re-trains exactly, and a
resumed run equals an uninterrupted one.

Real parts throughout: embedded engine (PEFT's layers injected, engine/hf/adapters.py), gateway, subprocess
digits agents, the torch trainer on PEFT. The learning rate is high so two steps move the adapter visibly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from test_train_e2e import dump, train_config

from relax_pipeline.config import CONF_DIR, register
from relax_pipeline.run import run

pytest.importorskip("peft", reason="trainer.lora needs PEFT: pip install -e '.[lora]'")
LORA = ("trainer.lora.rank=8", "trainer.optim.lr=5e-2")
EXACT = ("engine.max_batch_size=1", "engine.kv_cache_mb=0", "rollout.batch_size=1")
"""One request per engine batch and no prefix cache: logprobs bit-identical whichever requests share a batch."""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> tuple[Path, dict[str, float]]:
    out = tmp_path_factory.mktemp("lora")
    metrics = run(train_config(out, tiny_path, "rollout.num_steps=2", "trainer.save_interval=1",
                               "debug.replay_bundle=true", *LORA))
    return out, metrics


def replay_config(bundle: Path):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=["job=replay", f"replay.bundle={bundle}"])


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_a_lora_run_syncs_its_adapter_and_checkpoints_peft_folders(lora_run: tuple[Path, dict]) -> None:
    out, metrics = lora_run
    assert metrics["train/weight_version"] == 2 and metrics["perf/weight_sync_s"] > 0
    generated = [v for r in dump(out, 1) for v, m in zip(r["weight_versions"], r["loss_mask"], strict=True) if m]
    assert generated and set(generated) == {1}, "step 1's tokens come from the adapter synced after step 0"
    one, two = adapter(out / "checkpoints" / "step_1"), adapter(out / "checkpoints" / "step_2")
    assert one.keys() == two.keys() and any(not torch.equal(one[k], two[k]) for k in one)
    assert not (out / "checkpoints" / "step_2" / "model.safetensors").exists()


def test_job_eval_serves_an_adapter_checkpoint(lora_run: tuple[Path, dict], tiny_path: Path, tmp_path: Path) -> None:
    """The eval engine loads the base model and the checkpoint's adapter: its greedy logprobs are PEFT's model's."""
    from peft import AutoPeftModelForCausalLM

    out, _ = lora_run
    checkpoint = out / "checkpoints" / "step_2"
    digits = Path(__file__).resolve().parents[2] / "examples" / "toy_digits" / "data.jsonl"
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(digits.read_text().splitlines(keepends=True)[:2]))
    metrics = run(train_config(tmp_path, tiny_path, "job=eval", f"model.path={checkpoint}", *EXACT,
                               f"eval.datasets=[{{name:digits,path:{data}}}]"))
    assert "eval/digits/raw_reward" in metrics
    rows = dump(tmp_path, "eval_digits_0")
    model = AutoPeftModelForCausalLM.from_pretrained(checkpoint).eval()
    base_gaps = []
    for row in rows:
        assert gap(row, token_logprobs(model, row["tokens"], row["prompt_length"])) < 1e-5
        with model.disable_adapter():
            base_gaps.append(gap(row, token_logprobs(model, row["tokens"], row["prompt_length"])))
    assert max(base_gaps) > 1e-3, "the base model alone answers with other logprobs: the adapter was served"


def token_logprobs(model: torch.nn.Module, tokens: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[start + i - 1, t].item() for i, t in enumerate(tokens[start:])]


def gap(row: dict, expected: list[float]) -> float:
    """Largest gap between a dump row's response logprobs and `expected`, over its generated tokens."""
    pairs = zip(row["rollout_logprobs"], expected, row["loss_mask"], strict=True)
    return max(abs(a - b) for a, b, m in pairs if m)


@pytest.mark.parametrize("step", [0, 1])
def test_job_replay_retrains_a_lora_step_exactly(lora_run: tuple[Path, dict], step: int,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = lora_run
    metrics = run(replay_config(out / "replay" / f"step_{step}"))
    printed = capsys.readouterr().out
    assert metrics["replay/loss_identical"] == 1.0, printed
    assert metrics["replay/grad_norm_within_tolerance"] == 1.0, printed


def test_a_resumed_lora_run_equals_an_uninterrupted_one(tmp_path: Path, tiny_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(train_config(straight, tiny_path, "rollout.num_steps=3", *LORA, *EXACT))
    run(train_config(resumed, tiny_path, "rollout.num_steps=2", *LORA, *EXACT))
    run(train_config(resumed, tiny_path, "rollout.num_steps=3", "trainer.resume=true", *LORA, *EXACT))
    assert [r["tokens"] for r in dump(straight, 2)] == [r["tokens"] for r in dump(resumed, 2)]
    a, b = adapter(straight / "checkpoints" / "step_3"), adapter(resumed / "checkpoints" / "step_3")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
