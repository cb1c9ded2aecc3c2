"""Eval runs: every prompt of every `eval.datasets` entry, once, through the same stages in mode `eval`.

`recipes/parts.py` builds each entry (an `EvalSet`) with the train dataset's class and resolves its group size
and its concurrency in groups (`Capacity.eval_groups`: `runtime.eval_concurrency`, or `ceil(T / G)`, so
an eval holds about as many sessions as a train step). `Evaluator.run` evaluates the datasets one after
another through `Pipeline.start_group` / `await_group` / `score_group` with mode `eval` (agents see
`RELAX_ROLLOUT_MODE=eval`), then logs `eval/<name>/...` metrics and one
`AGENTIC EVAL event=eval_end` line per dataset and writes its dump rows (mode `eval`) to the dump pattern
with `{rollout_id}` → `eval_<name>_<steps done>`. Every metric also becomes a row `step,dataset,metric,value`
of `eval.csv` in the output folder (appended; the header is written with the first row). With
`per_problem` (`job=eval`) each dataset also writes `eval_<name>.csv` in the output folder, one row per
problem (`write_problem_csv`), and logs one summary line `eval <name>: ...` naming it.

When the run is stopping (`Pipeline.interrupt`), no further group starts; the groups already started
end dropped and go to the dump as usual, and the interrupted dataset yields no metrics.

What it does not do: train, filter, or call `credit.advantage_path` (credit options skip user advantage
hooks and filters for eval groups; rewards and reward models still score them), retry failed groups
(their sessions are recorded as failed/dropped and the run goes on), or give prompts to the train data
source. When to run is the step loop's business (`loop.py`, `Evaluator.due`).
"""

from __future__ import annotations

import asyncio
import csv
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from relax_pipeline.data.dataset import Prompt
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.tracking.dump import RolloutDump
from relax_pipeline.tracking.metrics import eval_metrics
from relax_pipeline.tracking.plot import plot_eval_curve

log = logging.getLogger(__name__)
EVAL_CSV = "eval.csv"


@dataclass(frozen=True)
class EvalSet:
    """One eval dataset as the run resolved it; connects `eval.datasets` to the Evaluator."""

    name: str
    dataset: Any
    """The built dataset (`dataset._target_`); its `prompts` are evaluated in order."""
    n_samples: int
    """Sessions per prompt (the group size)."""
    concurrency: int
    """Groups in flight."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """`eval.datasets[].metadata`: merged into every prompt's metadata (what the agent reads)."""

    def prompt(self, prompt: Prompt) -> Prompt:
        """`prompt` as this set evaluates it: its metadata with the set's merged in."""
        return replace(prompt, metadata={**prompt.metadata, **self.metadata}) if self.metadata else prompt


def append_eval_csv(output_dir: Path, step: int, name: str, metrics: dict[str, float]) -> Path:
    """Append one `step,dataset,metric,value` row per `eval/<name>/<metric>` to `<output_dir>/eval.csv`."""
    path, prefix = output_dir / EVAL_CSV, f"eval/{name}/"
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["step", "dataset", "metric", "value"])
        writer.writerows([step, name, key[len(prefix):], value] for key, value in metrics.items()
                         if key.startswith(prefix))
    return path


PROBLEM_COLUMNS = ("problem", "prompt", "samples", "scored", "reward", "passed", "statuses", "response", "metadata")
"""Columns of `eval_<name>.csv`: prompt index and text; sessions, scored contexts; mean primary reward and
the share equal to 1 over the scored contexts (empty when none); status counts; the first scored context's
last assistant message; the prompt's metadata as JSON."""


def write_problem_csv(output_dir: Path, name: str, results: list[tuple[Group, list[dict[str, Any]]]]) -> Path:
    """`<output_dir>/eval_<name>.csv`: one row per problem (group) in prompt order (`PROBLEM_COLUMNS`)."""
    path = output_dir / f"eval_{name}.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(PROBLEM_COLUMNS)
        for group, rows in sorted(results, key=lambda result: result[0].prompt.index):
            writer.writerow(_problem_row(group, rows))
    return path


def _problem_row(group: Group, rows: list[dict[str, Any]]) -> list[Any]:
    scored = [r for r in rows if r["status"] in ("completed", "truncated")]
    rewards = [r["reward"] for r in scored if isinstance(r["reward"], int | float)]
    statuses: dict[str, int] = {}
    for row in rows:
        statuses[row["status"]] = statuses.get(row["status"], 0) + 1
    prompt = group.prompt.input
    text = prompt if isinstance(prompt, str) else "" if prompt is None else json.dumps(prompt, ensure_ascii=False)
    return [group.prompt.index, text,
            len(group.sessions), len(scored), statistics.fmean(rewards) if rewards else "",
            statistics.fmean(r == 1 for r in rewards) if rewards else "",
            " ".join(f"{k}:{v}" for k, v in sorted(statuses.items())), _last_answer(scored),
            json.dumps(group.prompt.metadata, ensure_ascii=False, default=str)]


def _last_answer(scored: list[dict[str, Any]]) -> str:
    """The last assistant message's text of the first scored row; empty when there is none."""
    for message in reversed(scored[0]["messages"] if scored else []):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return ""


def eval_dump(dump: RolloutDump, name: str) -> RolloutDump:
    """The dump of one eval dataset: the run's pattern with `{rollout_id}` → `eval_<name>_{rollout_id}`."""
    pattern = dump.pattern.replace("{rollout_id}", f"eval_{name}_{{rollout_id}}") if dump.pattern else None
    return RolloutDump(pattern, dump.output_dir)


class Evaluator:
    """Runs every eval set through the pipeline in mode `eval`; returns `eval/<name>/...` metrics."""

    def __init__(self, pipeline: Pipeline, sets: list[EvalSet], interval: int, per_problem: bool = False) -> None:
        self.pipeline = pipeline
        self.sets = sets
        self.interval = interval
        self.per_problem = per_problem
        """Write `eval_<name>.csv` per dataset and a summary line (`job=eval`)."""
        self.dumps = {s.name: eval_dump(pipeline.dump, s.name) for s in sets}

    def due(self, done: int, first: bool = False) -> bool:
        """Before the first step of a run, and whenever `done` steps are a multiple of `eval.interval`."""
        return first or done % self.interval == 0

    async def run(self, done: int) -> dict[str, float]:
        """Evaluate every dataset with the weights after `done` steps."""
        metrics: dict[str, float] = {}
        for eval_set in self.sets:
            if self.pipeline.stopped:
                break
            metrics.update(await self._dataset(eval_set, done))
        return metrics

    async def _dataset(self, eval_set: EvalSet, done: int) -> dict[str, float]:
        started, slots = time.time(), asyncio.Semaphore(eval_set.concurrency)
        results: list[tuple[Group, list[dict[str, Any]]] | None] = []
        try:
            return await self._evaluate(eval_set, done, started, slots, results)
        finally:
            self.pipeline.release([result[0] for result in results if result is not None])

    async def _evaluate(self, eval_set: EvalSet, done: int, started: float, slots: asyncio.Semaphore,
                        results: list[tuple[Group, list[dict[str, Any]]] | None]) -> dict[str, float]:
        """One dataset's groups, dump, metrics and CSVs; `results` is filled with the finished groups."""
        total = len(eval_set.dataset.prompts) * eval_set.n_samples
        with tqdm(total=total, desc=f"eval {eval_set.name}", unit=" scored", file=sys.stderr, leave=False) as bar:
            self.pipeline.on_scored = bar.update
            results += await asyncio.gather(*(self._group(eval_set, p, done, slots)
                                              for p in eval_set.dataset.prompts))
        done_groups = [result for result in results if result is not None]
        groups = [group for group, _ in done_groups]
        rows = [row for _, group_rows in done_groups for row in group_rows]
        path = self.dumps[eval_set.name].write(done, rows)
        if self.pipeline.stopped:
            log.warning("eval %s after %d steps interrupted (%s): %d of %d problems started, no metrics; dump=%s",
                        eval_set.name, done, self.pipeline.stopped, len(groups), len(results), path)
            return {}
        metrics = eval_metrics(eval_set.name, rows, groups, self.pipeline.reward.credit.log_passrate)
        plot_eval_curve(append_eval_csv(self.pipeline.dump.output_dir, done, eval_set.name, metrics))
        self._log(eval_set.name, done, groups, rows, metrics, time.time() - started, path)
        if self.per_problem:
            csv_path = write_problem_csv(self.pipeline.dump.output_dir, eval_set.name, done_groups)
            self._summary(eval_set.name, len(groups), metrics, csv_path)
        return metrics

    async def _group(self, eval_set: EvalSet, prompt: Prompt, done: int, slots: asyncio.Semaphore
                     ) -> tuple[Group, list[dict[str, Any]]] | None:
        async with slots:
            if self.pipeline.stopped:
                return None
            group = await self.pipeline.start_group(done, "eval", prompt=eval_set.prompt(prompt),
                                                    n_samples=eval_set.n_samples)
            exports = await self.pipeline.await_group(group)
        return group, await self.pipeline.score_group(group, exports)

    @staticmethod
    def _summary(name: str, problems: int, metrics: dict[str, float], path: Path) -> None:
        """One line per dataset: problems, mean reward, pass rate when logged, dropped groups, the CSV."""
        figures = " ".join(f"{key}={metrics[f'eval/{name}/{key}']:.4f}" for key in ("raw_reward", "passrate")
                           if f"eval/{name}/{key}" in metrics)
        log.info("eval %s: problems=%d %s dropped_groups=%d per-problem results: %s", name, problems,
                 figures or "raw_reward=nan", int(metrics.get(f"eval/{name}/dropped_groups", 0)), path)

    @staticmethod
    def _log(name: str, done: int, groups: list[Group], rows: list[dict[str, Any]], metrics: dict[str, float],
             seconds: float, path: Any) -> None:
        reward = metrics.get(f"eval/{name}/raw_reward")
        log.info("AGENTIC EVAL event=eval_end dataset=%s after_steps=%d groups=%d rows=%d failed=%d dropped=%d "
                 "reward_mean=%s time_s=%.2f dump=%s", name, done, len(groups), len(rows),
                 sum(r["status"] == "failed" for r in rows), sum(1 for g in groups if g.dropped),
                 "nan" if reward is None else f"{reward:.4f}", seconds, path)
