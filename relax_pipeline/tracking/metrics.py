"""Rollout metrics with the names of docs/design.md §3.4.

`rollout/raw_reward` is the mean primary reward of the step's scored contexts; numeric fields of
reward objects (exported or produced by a reward model) become `rollout/<field>/{mean,median,max,min}`
and numeric top-level export metadata `<field>/{mean,median,max,min}`. Also turn counts, response
lengths, the truncated ratio, the dropped-group count (failures) and `rollout/filtered_groups` (groups a
credit filtered), and with `credit.log_passrate` the `passrate`: the share of scored sessions with a
context whose primary reward is 1.

`rollout/raw_reward` and `passrate` cover the groups the filter kept, so with a filter such as
`drop_uniform_rewards` they overstate the policy early (all-zero groups are dropped) and understate it
late (all-one groups are dropped). Beside them, over every scored group, kept or filtered:
`rollout/sampled_reward` (mean primary reward of its contexts), `rollout/sampled_passrate` (with
`credit.log_passrate`) and `rollout/kept_fraction` (kept groups / scored groups). `generated_tokens`
counts what a set of groups generated; the pipeline logs it as `rollout/wasted_tokens` for the groups
that were filtered or aborted as surplus. Eval datasets get the kept-group metrics under
`eval/<name>/...` (eval never filters, so the sampled and filter figures are left out).
`rollout/outcome/<name>` counts the step's sessions by their one outcome (the rows' `outcome`; the names are
`stages/group.py`'s `OUTCOMES`, the pipeline adds the absent ones as 0). Pure functions over dump rows and
groups; no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

SCORED = ("completed", "truncated")


def summary(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{prefix}/mean": statistics.fmean(values), f"{prefix}/median": statistics.median(values),
            f"{prefix}/max": max(values), f"{prefix}/min": min(values)}


def rollout_metrics(rows: Sequence[dict[str, Any]], groups: Sequence[Any], log_passrate: bool = False
                    ) -> dict[str, float]:
    """Metrics of one step from its dump rows and groups (whose contexts keep raw reward objects)."""
    scored = [r for r in rows if r["status"] in SCORED]
    rewards = [r["reward"] for r in scored if isinstance(r["reward"], int | float)]
    filtered = sum(1 for g in groups if g.filtered)
    metrics: dict[str, float] = {"rollout/dropped_groups": float(sum(1 for g in groups if g.dropped)),
                                 "rollout/filtered_groups": float(filtered),
                                 "rollout/fork_count": float(sum(len(s.forest.forks) for g in groups
                                                                 for s in g.sessions))}
    if rewards:
        metrics["rollout/raw_reward"] = statistics.fmean(rewards)
    metrics.update(sampled_metrics(groups, log_passrate))
    metrics.update(outcome_counts(rows))
    if scored:
        metrics["rollout/num_turns/mean"] = statistics.fmean(r["turn_count"] for r in scored)
        metrics["rollout/num_turns/max"] = float(max(r["turn_count"] for r in scored))
        metrics["rollout/response_len/mean"] = statistics.fmean(r["response_length"] for r in scored)
        metrics["rollout/truncated_ratio"] = sum(r["status"] == "truncated" for r in scored) / len(scored)
    objects = [c.reward_object for g in groups if not g.excluded for c in g.contexts]
    metrics.update(_numeric_fields(objects, [r["metadata"] for r in scored]))
    if log_passrate:
        metrics.update(passrate(groups))
    return metrics


TRAIN_ONLY = ("rollout/filtered_groups", "rollout/sampled_reward", "rollout/sampled_passrate", "rollout/kept_fraction",
              "rollout/wasted_tokens")
"""Metrics about the train filter, left out of eval metrics (eval never filters)."""


def sampled_metrics(groups: Sequence[Any], log_passrate: bool = False) -> dict[str, float]:
    """`rollout/sampled_reward`, `rollout/kept_fraction` (and `rollout/sampled_passrate`) over every scored
    group: kept or filtered, not dropped."""
    scored = [g for g in groups if not g.dropped]
    if not scored:
        return {}
    metrics = {"rollout/kept_fraction": sum(1 for g in scored if not g.filtered) / len(scored)}
    rewards = [c.reward for g in scored for c in g.contexts if isinstance(c.reward, int | float)]
    if rewards:
        metrics["rollout/sampled_reward"] = statistics.fmean(rewards)
    if log_passrate and (rate := _passrate(scored)) is not None:
        metrics["rollout/sampled_passrate"] = rate
    return metrics


def outcome_counts(rows: Iterable[dict[str, Any]]) -> dict[str, float]:
    """`rollout/outcome/<name>`: how many sessions (not rows: a session may export several contexts) ended so."""
    sessions = {(r["group_id"], r["index"]): r.get("outcome", r["status"]) for r in rows}
    counts: dict[str, float] = {}
    for outcome in sessions.values():
        counts[f"rollout/outcome/{outcome}"] = counts.get(f"rollout/outcome/{outcome}", 0.0) + 1.0
    return dict(sorted(counts.items()))


def generated_tokens(groups: Iterable[Any]) -> int:
    """Tokens the engine generated for the sessions of `groups` (every response node of their forests)."""
    return sum(len(node.token_ids) for g in groups for s in g.sessions for node in s.forest.nodes
               if node.kind == "response")


def eval_metrics(name: str, rows: Sequence[dict[str, Any]], groups: Sequence[Any], log_passrate: bool = False
                 ) -> dict[str, float]:
    """The rollout metrics of one eval dataset as `eval/<name>/raw_reward`, `eval/<name>/num_turns/mean`, ..."""
    metrics = rollout_metrics(rows, groups, log_passrate)
    for key in TRAIN_ONLY:
        metrics.pop(key, None)
    return {f"eval/{name}/{key.removeprefix('rollout/')}": value for key, value in metrics.items()}


def passrate(groups: Iterable[Any]) -> dict[str, float]:
    """`passrate`: per session of a scored group, 1 when a context of it has primary reward 1; the mean."""
    rate = _passrate([g for g in groups if not g.excluded])
    return {} if rate is None else {"passrate": rate}


def _passrate(groups: Iterable[Any]) -> float | None:
    passed = [any(c.reward == 1 for c in g.contexts if c.session_id == s.id) for g in groups for s in g.sessions]
    return statistics.fmean(passed) if passed else None


def _numeric_fields(objects: Iterable[Any], metadata: Iterable[Any]) -> dict[str, float]:
    reward_fields: dict[str, list[float]] = {}
    meta_fields: dict[str, list[float]] = {}
    for raw in objects:
        if isinstance(raw, dict):
            _collect(raw, reward_fields)
    for meta in metadata:
        if isinstance(meta, dict):
            _collect(meta, meta_fields)
    out: dict[str, float] = {}
    for name, values in reward_fields.items():
        out.update(summary(f"rollout/{name}", values))
    for name, values in meta_fields.items():
        out.update(summary(name, values))
    return out


def _collect(source: dict[str, Any], into: dict[str, list[float]]) -> None:
    for key, value in source.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            into.setdefault(key, []).append(float(value))
