"""A synthetic run output folder for the viewer's tests and bench: dump rows with the docs/design.md §3.4 fields and
invariants, a `config.yaml` naming the dump pattern, `run.log` metric and fork lines, `metrics.jsonl`.

`write_run_folder(root, steps, sessions, ...)` writes `steps` dump files of `sessions` sessions each (every
`fork_every`-th session forked into two chains, every `fail_every`-th failed with its group sibling dropped)
and returns the folder. Token ids, logprobs and rewards come from `random.Random(seed)`; the rows are
shaped like the real dump (same key order, `json.dumps` separators) but no model produced them.
`write_traces` adds session traces in the OTLP/JSON files `tracking.traces` writes (`traces/step_<n>.jsonl`),
`write_bundle` a replay bundle folder holding given rows (`replay/format.md`, without the trainer batch).
"""

from __future__ import annotations

import hashlib
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


def _span(trace: str, span: int, parent: int | None, name: str, start: int, end: int, attributes: dict[str, Any]
          ) -> dict[str, Any]:
    """One OTLP/JSON span (ids from counters; `intValue` as a string, as OTLP/JSON writes it)."""
    values = [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": str(v)}}
              for k, v in attributes.items()]
    return {"traceId": trace, "spanId": f"{span:016x}", "parentSpanId": f"{parent:016x}" if parent else "",
            "name": name, "kind": 1, "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": values}


def trace_request(session_id: str, step: int, versions: list[int], start_ns: int = 1_760_000_000_000_000_000,
                  abort_turn: int | None = None) -> dict[str, Any]:
    """One session's trace as an OTLP/JSON `ExportTraceServiceRequest`, the way `tracking.traces` writes it: a
    `session` span; per turn (`versions[k]`: its weight version) a `turn` span over `queue`, `prefill` and
    `decode` (with `abort` and `resume` in turn `abort_turn`), an `agent_gap` between turns; then `export`,
    `reward`, `credit`, and the `train_step` with two `micro_batch`es. Times are fixed: a turn takes 15 ms
    (20 ms with its abort), a gap 5 ms, so tests can check the layout exactly."""
    ms, trace = 1_000_000, hashlib.md5(session_id.encode()).hexdigest()
    base = {"relax.session_id": session_id, "relax.step": step}
    spans, ids = [], iter(range(1, 1000))
    session, t = next(ids), start_ns

    def add(parent: int, name: str, begin: int, length_ms: float, **attrs: Any) -> tuple[int, int]:
        span_id = next(ids)
        spans.append(_span(trace, span_id, parent, name, begin, begin + int(length_ms * ms), {**base, **attrs}))
        return span_id, begin + int(length_ms * ms)

    for k, version in enumerate(versions):
        if k:
            _, t = add(session, "agent_gap", t, 5)
        turn, end = add(session, "turn", t, 20 if k == abort_turn else 15, **{"relax.turn": k + 1,
                                                                             "relax.weight_version": version})
        for name, length in [("queue", 2), ("prefill", 3), ("decode", 10)] + (
                [("abort", 1), ("resume", 4)] if k == abort_turn else []):
            _, t = add(turn, name, t, length)
        t = end
    for name, length in [("export", 1), ("reward", 2), ("credit", 1)]:
        _, t = add(session, name, t, length)
    train, _ = add(session, "train_step", t, 20)
    for i in range(2):
        _, t = add(train, "micro_batch", t, 8, **{"relax.micro_batch": i})
    spans.insert(0, _span(trace, session, None, "session", start_ns, t + 4 * ms, base))
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name",
                                                             "value": {"stringValue": "relax_pipeline"}}]},
                               "scopeSpans": [{"scope": {"name": "relax_pipeline"}, "spans": spans}]}]}


def write_traces(root: Path, step: int, sessions: dict[str, list[int]], abort_turn: int | None = None) -> Path:
    """`<root>/traces/step_<step>.jsonl`: one `trace_request` line per session id (→ its turns' weight versions)."""
    path = root / "traces" / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(trace_request(s, step, v, abort_turn=abort_turn)) for s, v in sessions.items()]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_bundle(folder: Path, step: int, rows: list[dict[str, Any]], metrics: dict[str, float]) -> Path:
    """A replay bundle folder (`replay/format.md`) holding `rows` as its dump and one credit line per group (no
    trainer batch): enough for the viewer, not for `job=replay`."""
    from relax_pipeline.replay import format as fmt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / fmt.ROWS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups: dict[str, list[dict[str, Any]]] = {}
    for line, row in enumerate(rows):
        if row.get("tokens"):
            groups.setdefault(row["group_id"], []).append(
                {"slot": row["index"], "session_id": row["session_id"], "name": row["name"], "branch": row["branch"],
                 "exported_reward": row["reward"], "reward": row["reward"], "advantage": row["advantage"],
                 "truncated_failure": False, "row": line})
    (folder / fmt.CREDIT).write_text("".join(json.dumps({"group_id": g, "mode": "train", "slots": 2, "filtered": None,
                                                         "dropped": None, "contexts": c}) + "\n"
                                             for g, c in groups.items()))
    (folder / fmt.METRICS).write_text(json.dumps(metrics))
    (folder / fmt.CONFIG).write_text(f"job: train\ndebug:\n  save_rollout_data: {PATTERN}\n")
    (folder / fmt.MANIFEST).write_text(json.dumps({
        "format_version": fmt.FORMAT_VERSION, "step": step, "written_at": 0.0,
        "code_version": {"package": "0.1.0", "git": None}, "model_path": None, "samples": len(rows),
        "checkpoint_before": None, "checkpoint_after": None}))
    return folder
