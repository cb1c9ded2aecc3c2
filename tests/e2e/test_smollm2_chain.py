"""`experiment=smollm2_chain` end to end for two steps, on the tiny model with `engine=scripted` replaying a
two-call transcript (`calc 47 + 86`, `calc 133 * 12`, the answer): the real calculator agent
(examples/arith/calc_agent.py) as subprocesses, the gateway, the trainer, and the preset's own eval sets (the
generated held-out problems needing 1, 2 and 3 calls, and the control). Multi-turn samples carry loss only on the
model's tokens (both calculator replies are prompt), and the eval writes success, calls and chaining by calls
needed: the replayed transcript is the right answer to the train problem only, and its second call always takes
its first call's value."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from test_e2e_rollout import check_row, read_dump
from test_smollm2_agent import eval_figures, loss_text
from transformers import AutoTokenizer

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run

SCRIPT = [{"content": "calc 47 + 86"}, {"content": "calc 133 * 12"}, {"content": "The answer is 1596."}]
"""Every session replays it (the scripted engine picks a line by the assistant turns already in the prompt)."""


def compose_preset(tmp_path: Path, tiny_path: Path):  # noqa: ANN201
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"input": "What is (47 + 86) * 12?", "metadata": {"answer": 1596, "steps": 2}}) + "\n")
    (tmp_path / "script.jsonl").write_text("".join(json.dumps(line) + "\n" for line in SCRIPT))
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "experiment=smollm2_chain", "agent.env.ARITH_EXAMPLE=none", "model=tiny",
            f"model.cache_dir={tiny_path.parent}", "engine=scripted", f"engine.script={tmp_path / 'script.jsonl'}",
            f"dataset.path={one}", "dataset.heldout_size=6", "dataset.validation_size=3", "dataset.train_size=3",
            "rollout.num_steps=2", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
            "rollout.over_sampling_batch_size=1", "credit.filter_path=null", "eval.interval=1",
            f"output_dir={tmp_path}", f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl"]))


def test_two_steps_train_a_two_call_chain_on_model_tokens_and_eval_by_calls_needed(tmp_path: Path,
                                                                                    tiny_path: Path) -> None:
    run(compose_preset(tmp_path, tiny_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    rows = read_dump(tmp_path / "dump" / "r_0.jsonl") + read_dump(tmp_path / "dump" / "r_1.jsonl")
    assert len(rows) == 4
    for row in rows:
        check_row(row)
        assert row["turn_count"] == 3 and row["reward"] == 1.0
        assert row["metadata"]["calls"] == 2.0 and row["metadata"]["chained"] == 1.0
        trained = loss_text(row, tokenizer, 1)
        assert all(line["content"] in trained for line in SCRIPT) and "calculator" not in trained
        untrained = loss_text(row, tokenizer, 0)
        assert "calculator: 47 + 86 = 133" in untrained and "calculator: 133 * 12 = 1596" in untrained  # ARITH_ECHO
    figures = eval_figures(tmp_path)
    for calls in (1, 2, 3):  # every held-out problem gets the same two calls and a wrong answer
        assert figures[(f"heldout_{calls}", "raw_reward")] == 0.0
        assert figures[(f"heldout_{calls}", f"solved_{calls}/mean")] == 0.0
        assert figures[(f"heldout_{calls}", f"calls_{calls}/mean")] == 2.0
    assert ("heldout_1", "chained/mean") not in figures
    assert figures[("heldout_2", "chained/mean")] == figures[("heldout_3", "linked/mean")] == 1.0
    assert figures[("control", "calls/mean")] == 0.0 and figures[("control", "num_turns/mean")] == 1.0
    assert figures[("control", "solved_2/mean")] == 0.0 and figures[("control", "tools/mean")] == 0.0
