"""A synthetic run output folder for the viewer's tests and bench: dump rows with the docs/design.md §3.4 fields and
invariants, a `config.yaml` naming the dump pattern, `run.log` metric and fork lines, `metrics.jsonl`.

`write_run_folder(root, steps, sessions, ...)` writes `steps` dump files of `sessions` sessions each (every
`fork_every`-th session forked into two chains, every `fail_every`-th failed with its group sibling dropped)
and returns the folder. Token ids, logprobs and rewards come from `random.Random(seed)`; the rows are
shaped like the real dump (same key order, `json.dumps` separators) but no model produced them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from relax_pipeline.tracking.metrics_file import METRICS_FILE

PATTERN = "dump/rollout_{rollout_id}.jsonl"


def dump_row(rng: random.Random, step: int, session: int, branch: int | None = None, status: str = "completed",
             prompt: int = 12, response: int = 24, version: int = 0) -> dict[str, Any]:
    """One row in the dump's key order; a failed or dropped row has no tokens and carries an error."""
    scored = status in ("completed", "truncated", "filtered")
    user = {"role": "user", "content": f"question {session}"}
    answers = [f"answer {session}", f"rewritten {session}"]
    messages = [user, {"role": "assistant", "content": answers[branch or 0]}] if scored else []
    mask = [1] * response if scored else []
    return {"rollout_id": step, "group_id": f"g{step}-{session // 2}", "session_id": f"sess-{step}-{session}",
            "index": session % 2, "mode": "train", "status": status,
            "error": None if scored else f"agent exited with code 3 ({status} on purpose)",
            "timing": {"created": 0.0, "turns": [{"queue_ms": 1.0, "generation_ms": 2.0, "total_ms": 3.0}]},
            "name": None, "branch": branch, "reward": float(rng.random() < 0.5) if scored else None,
            "advantage": rng.uniform(-1, 1) if scored else None, "metadata": {"k": session}, "messages": messages,
            "tools": [], "chat_template_kwargs": {}, "state_hash": "0" * 32 if scored else None,
            "tokens": [rng.randrange(5, 400) for _ in range((prompt + response) if scored else 0)],
            "loss_mask": mask, "rollout_logprobs": [round(-rng.random() * 3, 4) for _ in mask],
            "weight_versions": [version] * len(mask), "prompt_length": prompt if scored else 0,
            "response_length": len(mask), "turn_count": 1 if scored else 0, "abort_count": 0}


def step_rows(rng: random.Random, step: int, sessions: int, fork_every: int, fail_every: int,
              response: int) -> list[dict[str, Any]]:
    rows = []
    for s in range(sessions):
        if fail_every and s % fail_every == 0:
            rows.append(dump_row(rng, step, s, status="failed"))
        elif fail_every and s % fail_every == 1:
            rows.append(dump_row(rng, step, s, status="dropped"))
        elif fork_every and s % fork_every == 2:
            rows += [dump_row(rng, step, s, b, response=response, version=step) for b in (0, 1)]
        else:
            rows.append(dump_row(rng, step, s, response=response, version=step))
    return rows


def write_run_folder(root: Path, steps: int = 2, sessions: int = 8, fork_every: int = 4, fail_every: int = 0,
                     response: int = 24, seed: int = 0) -> Path:
    """The folder described in the module docstring."""
    rng = random.Random(seed)
    (root / "dump").mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(f"job: train\nseed: 0\nmodel:\n  name: tiny\n  path: null\n"
                                      f"debug:\n  save_rollout_data: {PATTERN}\n")
    log, metrics = [], []
    for step in range(steps):
        rows = step_rows(rng, step, sessions, fork_every, fail_every, response)
        with open(root / PATTERN.format(rollout_id=step), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        forked = {r["session_id"] for r in rows if r["branch"] == 1}
        log += [f"2026-01-01 00:00:00,000 INFO relax_pipeline.turn.service: session {s} turn 2 forked: re-sent "
                "assistant message 1 differs in content; new branch below node 1" for s in sorted(forked)]
        values = {"rollout/raw_reward": step / max(steps, 1), "rollout/fork_count": float(len(forked))}
        log.append(f"2026-01-01 00:00:00,000 INFO relax_pipeline: step {step} metrics "
                   + " ".join(f"{k}={v:.4g}" for k, v in sorted(values.items())))
        metrics.append(json.dumps({"step": step, "time": 0.0, "metrics": values}))
    (root / "run.log").write_text("".join(line + "\n" for line in log))
    (root / METRICS_FILE).write_text("".join(line + "\n" for line in metrics))
    return root
