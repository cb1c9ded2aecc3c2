"""`kill -9` of a whole training run during step 3, then `trainer.resume=true`: the run continues from the last
checkpoint with the same data order, trains no prompt twice and skips none, and appends to the dump.

A `python -m relax_pipeline` subprocess (job=train, tiny model, shuffled data, a checkpoint after every step)
is SIGKILLed while the agents of step 3 wait; nothing of it gets to clean up. What such a kill can leave is
added by hand: a dump line cut in the middle and a half-written checkpoint folder. The resumed run (in
process) must ignore both, and its prompt ids per step (group ids are `g<step>-<prompt index>-<hex>`), dump
rows and final weights (bitwise: one group a step, so training sees its samples in one order) must equal
those of an uninterrupted run with the same config.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_stop_and_resume import compose_config, start_cli, wait_for

from relax_pipeline.run import run

DIGITS_AGENT = Path(__file__).resolve().parents[1] / "agents" / "digits_agent.py"
HOLD = ["+agent.env.HOLD_GROUP=g3-", "+agent.env.HOLD_FILE=hold_step_3"]
"""The digits agent waits in train groups `g3-*` while `hold_step_3` exists in the work folder."""
STEPS = 5


def overrides(out: Path, tiny_path: Path, *extra: str) -> list[str]:
    data = out.parent / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + {i}?"}) + "\n" for i in range(16)))
    return ["job=train", f"output_dir={out}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=true", f"agent.command='{sys.executable} {DIGITS_AGENT}'", *HOLD,
            f"agent.cwd={out.parent}",
            f"rollout.num_steps={STEPS}", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=6", "engine.max_batch_size=1", "engine.kv_cache_mb=0", "trainer.optim.lr=5e-3",
            "trainer.save_interval=1", f"debug.save_rollout_data={out}/dump/r_{{rollout_id}}.jsonl", *extra]


def rows(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "dump" / f"r_{step}.jsonl").read_text().splitlines()]


def trained_prompts(out: Path) -> list[tuple[int, int]]:
    """(step, prompt index) of every trained group, from the group ids of its scored rows, sorted."""
    found = set()
    for step in range(STEPS):
        for row in rows(out, step):
            if row["status"] in ("completed", "truncated"):
                name, prompt, _ = row["group_id"].split("-")
                assert name == f"g{step}"
                found.add((step, int(prompt)))
    return sorted(found)


def test_kill_9_during_step_3_resumes_with_the_same_data_order_and_appends_the_dump(tmp_path: Path,
                                                                                    tiny_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hold_step_3").touch()
    killed = work / "killed"
    proc = start_cli(overrides(killed, tiny_path), work)
    try:
        wait_for(lambda: list((killed / "sessions").glob("g3-*/started")), proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        (work / "hold_step_3").unlink()  # the orphaned agents stop waiting (their gateway is gone)
    assert proc.returncode == -signal.SIGKILL
    folder = killed / "checkpoints"
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_1", "step_2", "step_3"]
    assert not (killed / "dump" / "r_3.jsonl").exists(), "step 3 was killed before its end"
    before = {step: (killed / "dump" / f"r_{step}.jsonl").read_bytes() for step in range(3)}
    # What a kill at a worse moment leaves: a dump line cut mid-write, a checkpoint folder half written.
    (killed / "dump" / "r_3.jsonl").write_text('{"rollout_id": 3, "group_id": "g3-')
    (folder / ".step_4.tmp").mkdir()
    (folder / ".step_4.tmp" / "model.safetensors").write_bytes(b"\0" * 10)

    run(compose_config(overrides(killed, tiny_path, "trainer.resume=true", f"trainer.checkpoint_dir={folder}")))
    straight = work / "straight"
    run(compose_config(overrides(straight, tiny_path)))

    assert {step: (killed / "dump" / f"r_{step}.jsonl").read_bytes() for step in range(3)} == before
    assert trained_prompts(killed) == trained_prompts(straight)
    prompts = [prompt for _, prompt in trained_prompts(killed)]
    assert len(prompts) == STEPS and len(set(prompts)) == len(prompts), "no prompt trained twice or skipped"
    for step in range(STEPS):
        assert sorted(r["tokens"] for r in rows(killed, step)) == sorted(r["tokens"] for r in rows(straight, step))
    a, b = (load_file(o / "checkpoints" / f"step_{STEPS}" / "model.safetensors") for o in (killed, straight))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (folder / ".step_4.tmp").exists()
