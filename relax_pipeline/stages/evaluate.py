"""Eval runs: every prompt of every `eval.datasets` entry, once, through the same stages in mode `eval`.

`run.py` builds each entry (an `EvalSet`) with the train dataset's class and resolves its group size
and its concurrency in groups (`Capacity.eval_groups`: `runtime.eval_concurrency`, or `ceil(T / G)`, so
an eval holds about as many sessions as a train step). `Evaluator.run` evaluates the datasets one after
another through `Pipeline.start_group` / `await_group` / `score_group` with mode `eval` (agents see
`RELAX_ROLLOUT_MODE=eval`), then logs `eval/<name>/...` metrics and one
`AGENTIC EVAL event=eval_end` line per dataset and writes its dump rows (mode `eval`) to the dump pattern
with `{rollout_id}` → `eval_<name>_<steps done>`. Every metric also becomes a row `step,dataset,metric,value`
of `eval.csv` in the output folder (appended; the header is written with the first row).

What it does not do: train, filter, or call `credit.advantage_path` (credit options skip user advantage
hooks and filters for eval groups; rewards and reward models still score them), retry failed groups
(their sessions are recorded as failed/dropped and the run goes on), or give prompts to the train data
source. When to run is the step loop's business (`loop.py`, `Evaluator.due`).
"""

from __future__ import annotations

import asyncio
import csv
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from relax_pipeline.data.dataset import Prompt
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline
from relax_pipeline.tracking.dump import RolloutDump
from relax_pipeline.tracking.metrics import eval_metrics

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


def eval_dump(dump: RolloutDump, name: str) -> RolloutDump:
    """The dump of one eval dataset: the run's pattern with `{rollout_id}` → `eval_<name>_{rollout_id}`."""
    pattern = dump.pattern.replace("{rollout_id}", f"eval_{name}_{{rollout_id}}") if dump.pattern else None
    return RolloutDump(pattern, dump.output_dir)


class Evaluator:
    """Runs every eval set through the pipeline in mode `eval`; returns `eval/<name>/...` metrics."""

    def __init__(self, pipeline: Pipeline, sets: list[EvalSet], interval: int) -> None:
        self.pipeline = pipeline
        self.sets = sets
        self.interval = interval
        self.dumps = {s.name: eval_dump(pipeline.dump, s.name) for s in sets}

    def due(self, done: int, first: bool = False) -> bool:
        """Before the first step of a run, and whenever `done` steps are a multiple of `eval.interval`."""
        return first or done % self.interval == 0

    async def run(self, done: int) -> dict[str, float]:
        """Evaluate every dataset with the weights after `done` steps."""
        metrics: dict[str, float] = {}
        for eval_set in self.sets:
            metrics.update(await self._dataset(eval_set, done))
        return metrics

    async def _dataset(self, eval_set: EvalSet, done: int) -> dict[str, float]:
        started, slots = time.time(), asyncio.Semaphore(eval_set.concurrency)
        total = len(eval_set.dataset.prompts) * eval_set.n_samples
        with tqdm(total=total, desc=f"eval {eval_set.name}", unit=" scored", file=sys.stderr, leave=False) as bar:
            self.pipeline.on_scored = bar.update
            done_groups = await asyncio.gather(*(self._group(eval_set, p, done, slots)
                                                 for p in eval_set.dataset.prompts))
        groups = [group for group, _ in done_groups]
        rows = [row for _, group_rows in done_groups for row in group_rows]
        path = self.dumps[eval_set.name].write(done, rows)
        metrics = eval_metrics(eval_set.name, rows, groups, self.pipeline.reward.credit.log_passrate)
        append_eval_csv(self.pipeline.dump.output_dir, done, eval_set.name, metrics)
        self._log(eval_set.name, done, groups, rows, metrics, time.time() - started, path)
        return metrics

    async def _group(self, eval_set: EvalSet, prompt: Prompt, done: int, slots: asyncio.Semaphore
                     ) -> tuple[Group, list[dict[str, Any]]]:
        async with slots:
            group = await self.pipeline.start_group(done, "eval", prompt=prompt, n_samples=eval_set.n_samples)
            exports = await self.pipeline.await_group(group)
        return group, await self.pipeline.score_group(group, exports)

    @staticmethod
    def _log(name: str, done: int, groups: list[Group], rows: list[dict[str, Any]], metrics: dict[str, float],
             seconds: float, path: Any) -> None:
        reward = metrics.get(f"eval/{name}/raw_reward")
        log.info("AGENTIC EVAL event=eval_end dataset=%s after_steps=%d groups=%d rows=%d failed=%d dropped=%d "
                 "reward_mean=%s time_s=%.2f dump=%s", name, done, len(groups), len(rows),
                 sum(r["status"] == "failed" for r in rows), sum(1 for g in groups if g.dropped),
                 "nan" if reward is None else f"{reward:.4f}", seconds, path)
