"""`experiment=smollm2_agent` end to end for two steps, on the tiny model with `engine=scripted` replaying a
tool-using transcript (`calc 47 * 86`, then the answer): the real calculator agent (examples/arith/calc_agent.py)
as subprocesses, the gateway, the trainer. Multi-turn samples carry loss only on the model's tokens (the
calculator's reply carries none), and the eval writes success, tool-use share, turns and
the single-shot control (the same transcript without the tool: its first reply is its answer)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from test_e2e_rollout import check_row, read_dump
from transformers import AutoTokenizer

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run

SCRIPT = [{"content": "calc 47 * 86"}, {"content": "The answer is 4042."}]
"""Every session replays it (the scripted engine picks a line by the assistant turns already in the prompt): a
tool session calls, then answers; the control's one reply is the call, whose last number (86) is wrong."""


def compose_preset(tmp_path: Path, tiny_path: Path):  # noqa: ANN201
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"input": "What is 47 * 86?", "metadata": {"answer": 4042}}) + "\n")
    (tmp_path / "script.jsonl").write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    evals = f"[{{name: heldout, path: '{one}'}}, {{name: control, path: '{one}', metadata: {{tools: false}}}}]"
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "experiment=smollm2_agent", "agent.env.ARITH_EXAMPLE=none", "model=tiny",
            f"model.cache_dir={tiny_path.parent}", "engine=scripted",
            f"engine.script={tmp_path / 'script.jsonl'}", f"dataset.path={one}", "rollout.num_steps=2",
            "rollout.batch_size=1", "rollout.n_samples_per_prompt=2", "rollout.over_sampling_batch_size=1",
            "credit.filter_path=null", "eval.interval=1", f"eval.datasets={evals}", f"output_dir={tmp_path}",
            f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl"]))


def loss_text(row: dict, tokenizer: AutoTokenizer, mask: int) -> str:
    """The response tokens whose loss mask is `mask`, decoded."""
    response = row["tokens"][row["prompt_length"]:]
    return tokenizer.decode([t for t, m in zip(response, row["loss_mask"], strict=True) if m == mask])


def eval_figures(output_dir: Path) -> dict[tuple[str, str], float]:
    """(dataset, metric) → value of the last eval in eval.csv."""
    with (output_dir / "eval.csv").open() as f:
        return {(r["dataset"], r["metric"]): float(r["value"]) for r in csv.DictReader(f)}


def test_two_steps_train_on_model_tokens_only_and_eval_reports_the_control(tmp_path: Path, tiny_path: Path) -> None:
    run(compose_preset(tmp_path, tiny_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl") + read_dump(tmp_path / "dump" / "r_1.jsonl")
    assert len(rows) == 4 and (tmp_path / "checkpoints" / "step_2").is_dir()
    for row in rows:
        check_row(row)
        assert row["turn_count"] == 2 and row["reward"] == 1.0 and row["metadata"]["used_tool"] == 1.0
        trained = loss_text(row, tokenizer, 1)
        assert "calc 47 * 86" in trained and "The answer is 4042." in trained
        untrained = loss_text(row, tokenizer, 0)
        assert "calculator: 4042" in untrained and "calculator" not in trained
    figures = eval_figures(tmp_path)
    assert figures[("heldout", "raw_reward")] == 1.0 and figures[("heldout", "used_tool/mean")] == 1.0
    assert figures[("heldout", "num_turns/mean")] == 2.0
    assert figures[("control", "raw_reward")] == 0.0 and figures[("control", "used_tool/mean")] == 0.0
    assert figures[("control", "num_turns/mean")] == 1.0 and figures[("control", "tools/mean")] == 0.0
