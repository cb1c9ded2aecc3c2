"""The step loop of `job=rollout` and `job=train`: rollout → credit → (train → weight sync) → checkpoint.

Each step asks the runtime strategy for one step of scored groups, turns their contexts into training
samples, trains (in a worker thread, so the gateway keeps serving agents that run across steps), pushes
the new weights to the engine as the trainer's new version, logs the step's metrics and saves a
checkpoint every `trainer.save_interval` steps and after the last. `trainer.resume=true` restores the
latest checkpoint (weights, optimizer, RNG, step count, data position, weight version) first, and
`trainer.keep_checkpoints` keeps only the last N checkpoint folders. With an evaluator, eval runs before
the first step and every `eval.interval` steps (`_eval`); `job=eval` is this loop with no steps and an
evaluator. The loop does not build anything: the job's recipe (`relax_pipeline/recipes/`) hands it the parts.

Stopping (`request_stop`, called through run.py's signals on the first SIGINT or SIGTERM): the pipeline starts no more
groups and drops the running ones (recorded in the dump as `dropped`); a step interrupted during its
rollout is not trained (its rows still go to the dump), a step whose rollout had finished is completed
(training cannot be cut short). Then the loop writes a checkpoint of the last finished step unless one
exists already and raises `RunInterrupted`, whose message says where the checkpoint is and how to resume
and whose `exit_code` is 128 + the signal number (130 for SIGINT, 143 for SIGTERM).

Before each step, `settle_garbage` collects and then freezes every surviving object (the model, the
tokenizer, the forests of earlier steps), so the collector's automatic full collections during the step
traverse only that step's objects: without it, each one walks every forest node of the run and stalls
the gateway's event loop for hundreds of milliseconds. Every `FULL_GC_STEPS` steps the frozen objects
are unfrozen first, so reference cycles that died after being frozen are reclaimed too. Since every step starts
with a full collection, automatic full collections during a step only do part of that work early: settling also
sets the oldest generation's threshold to `GC_OLDEST_THRESHOLD` (Python's is 10), so they come ten times more
rarely (a dead cycle that reached the oldest generation waits for the next step, or for 100 collections of the
middle one); the younger generations keep Python's thresholds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from relax_pipeline.engine.base import Engine
from relax_pipeline.forest.sample import Sample
from relax_pipeline.replay.recorder import StepRecorder
from relax_pipeline.scheduling.base import RuntimeStrategy
from relax_pipeline.stages.evaluate import Evaluator
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.pipeline import Pipeline, StepResult
from relax_pipeline.stages.traces import TrainTiming, step_traces, train_timing
from relax_pipeline.tracking.console import eval_progress, step_progress
from relax_pipeline.tracking.traces import TraceWriter
from relax_pipeline.tracking.tracker import Tracker
from relax_pipeline.train.allocator import release_freed_memory
from relax_pipeline.train.base import Trainer
from relax_pipeline.train.settings import CheckpointSettings

log = logging.getLogger("relax_pipeline")
_STEP_DIR = re.compile(r"^step_(\d+)$")
FULL_GC_STEPS = 10
GC_OLDEST_THRESHOLD = 100


class RunInterrupted(Exception):
    """The run stopped on a signal after saving what it could; the message says where the checkpoint is."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
        """130 for SIGINT, 143 for SIGTERM."""


@dataclass
class Checkpoints:
    """Where checkpoints go, how often and how many stay; connects the trainer config to the loop."""

    folder: Path
    interval: int | None
    resume: bool
    keep: int | None = None
    """`trainer.keep_checkpoints`: the last N step folders stay after each save; None keeps all."""

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"trainer.keep_checkpoints={self.keep} must be at least 1, or null to keep every "
                             "checkpoint")

    @classmethod
    def of(cls, settings: CheckpointSettings, output_dir: Path) -> Checkpoints:
        """The `trainer` node's checkpoint schedule; `trainer.checkpoint_dir` null: `<output>/checkpoints`."""
        folder = Path(settings.checkpoint_dir or output_dir / "checkpoints").expanduser()
        return cls(folder, settings.save_interval, settings.resume, settings.keep_checkpoints)

    def steps(self) -> list[tuple[int, Path]]:
        """Every `step_<n>` folder, oldest first."""
        return sorted((int(m.group(1)), p) for p in self.folder.glob("step_*") if (m := _STEP_DIR.match(p.name)))

    def latest(self) -> Path | None:
        steps = self.steps()
        return steps[-1][1] if steps else None

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.interval is not None and (step + 1) % self.interval == 0)

    def prune(self) -> list[Path]:
        """Delete all but the last `keep` step folders; returns the deleted ones."""
        old = [path for _, path in self.steps()[:-self.keep]] if self.keep is not None else []
        for path in old:
            shutil.rmtree(path, ignore_errors=True)
        return old


class StepLoop:
    """Runs `num_steps` rollout steps, training between them when a trainer is given."""

    def __init__(self, pipeline: Pipeline, strategy: RuntimeStrategy, engine: Engine, tracker: Tracker,
                 num_steps: int, trainer: Trainer | None = None, checkpoints: Checkpoints | None = None,
                 evaluator: Evaluator | None = None, *, recorder: StepRecorder | None = None,
                 traces: TraceWriter | None = None) -> None:
        self.pipeline = pipeline
        self.strategy = strategy
        self.engine = engine
        self.tracker = tracker
        self.num_steps = num_steps
        self.trainer = trainer
        self.checkpoints = checkpoints
        self.history: list[dict[str, float]] = []
        self.evaluator = evaluator
        self.recorder = recorder
        """`debug.replay_bundle`: writes the chosen steps' replay bundles (relax_pipeline/replay/); None: off."""
        self.traces = traces
        """`tracking.traces`: writes each step's session traces (tracking/traces.py); None: off."""
        self._trained: TrainTiming | None = None
        """When the current step's `trainer.train` ran, and its micro-batches (the traces' `train_step`)."""
        self.eval_metrics: dict[str, float] = {}
        self.stop_signal: int | None = None
        """The signal that asked the run to stop (`request_stop`), None while it runs on."""
        self.done = 0
        """Steps finished (resumed ones included)."""
        self.saved: int | None = None
        """Finished steps in the last checkpoint this run wrote or resumed from."""
        self._data: dict[str, Any] = {}
        """The data position when the last step finished (what a checkpoint of it holds)."""

    def request_stop(self, signum: int) -> None:
        """Stop soon (first SIGINT/SIGTERM): no group starts, running groups are dropped, see the module."""
        if self.stop_signal is not None:
            return
        self.stop_signal = signum
        dropped = self.pipeline.interrupt(f"interrupted by {signal.Signals(signum).name}")
        log.warning("%s: stopping; %d running groups dropped, a checkpoint of the last finished step follows "
                    "(send it again to exit at once, without one)", signal.Signals(signum).name, dropped)

    async def run(self) -> dict[str, float]:
        """Every step; returns the last step's metrics plus the latest eval's. The traces are flushed at the end."""
        try:
            return await self._steps()
        finally:
            if self.traces is not None:
                await asyncio.to_thread(self.traces.close)

    async def _steps(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        first = self.done = await self._resume()
        self._data = self.pipeline.source.state()
        await self._eval(first, before_first_step=True)
        for step in range(first, self.num_steps):
            if self.stop_signal is not None:
                break
            settle_garbage(full=(step - first) % FULL_GC_STEPS == 0)
            started = time.time()
            self._engine_metrics()  # what the engine did before this step (an eval) is not this step's
            result = await self._rollout(step)
            if self.stop_signal is not None:
                log.warning("step %d interrupted during its rollout: not trained (its rows are in the dump)", step)
                break
            metrics = {**result.metrics, **self._engine_metrics()}
            self._trained = None
            if self.trainer is not None:
                metrics.update(await self._train(result))
            metrics["perf/step_time"] = time.time() - started
            self.tracker.log(metrics, step)
            if self.traces is not None:
                self.traces.submit(step, step_traces(result.groups, step, self._trained))
            self.history.append(metrics)
            log.info("step %d metrics %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())),
                     extra=step_progress(step + 1, self.num_steps, {**metrics, **self.eval_metrics}))
            self.done, self._data = step + 1, self.pipeline.source.state()
            self._save(step)
            self._record(step, result, metrics)
            await self._eval(step + 1)
            release_freed_memory()  # the step's, the checkpoint's and the eval's holes (train/allocator.py)
        gc.unfreeze()  # what the run leaves behind is collected as usual
        if self.stop_signal is not None:
            raise self._interrupted(self.stop_signal)
        self._report()
        self._check_trained()
        return {**metrics, **self.eval_metrics}

    def _interrupted(self, signum: int) -> RunInterrupted:
        """Checkpoint the last finished step (unless saved already); the error saying where and how to resume."""
        name = signal.Signals(signum).name
        if self.trainer is None or self.checkpoints is None:
            return RunInterrupted(f"run interrupted by {name} after {self.done} steps; this job trains nothing, so "
                                  "there is no checkpoint", signum)
        if self.done == 0:
            return RunInterrupted(f"run interrupted by {name} before its first step finished: no checkpoint (run "
                                  "again to start over)", signum)
        if self.saved != self.done:
            self._write(self.done)
        folder = self.checkpoints.folder.resolve()
        return RunInterrupted(f"run interrupted by {name} after {self.done} steps: checkpoint {folder}/step_"
                              f"{self.done}; resume with trainer.resume=true trainer.checkpoint_dir={folder}", signum)

    def _check_trained(self) -> None:
        """A training run in which no step had a sample to train on failed, whatever else went well."""
        if self.trainer is None or not self.history or any(m.get("train/samples") for m in self.history):
            return
        raise ValueError(f"every one of the {len(self.history)} steps trained on 0 samples (every group was "
                         "dropped, filtered or unrewarded); the dump and run.log say why for each session")

    async def _eval(self, done: int, before_first_step: bool = False) -> None:
        """Eval hook (stages/evaluate.py): before the first step and every `eval.interval` steps."""
        if self.evaluator is None or self.stop_signal is not None or not self.evaluator.due(done, before_first_step):
            return
        metrics = await self.evaluator.run(done)
        if self.stop_signal is not None:
            return  # an interrupted eval has no metrics to log
        self.eval_metrics = metrics
        self.tracker.log(self.eval_metrics, done)
        log.info("eval after %d steps metrics %s", done,
                 " ".join(f"{k}={v:.4g}" for k, v in sorted(self.eval_metrics.items())),
                 extra=eval_progress(done, self.eval_metrics))

    async def _rollout(self, step: int) -> StepResult:
        total = self.pipeline.batch_size * self.pipeline.prepare.n_samples
        with tqdm(total=total, desc=f"step {step + 1}/{self.num_steps}", unit=" scored", file=sys.stderr,
                  leave=False) as bar:
            self.pipeline.on_scored = bar.update
            return await self.strategy.rollout(self.pipeline, step)

    async def _train(self, result: StepResult) -> dict[str, float]:
        samples = train_samples(result.groups)
        if not samples:
            message = (f"step {result.rollout_id}: trained on 0 samples (every group dropped, filtered or "
                       "unrewarded); see the dump rows' status and error")
            log.warning(message)
            return {"train/samples": 0.0}
        began = time.time_ns()
        metrics = await asyncio.to_thread(self.trainer.train, samples)
        # a trainer without a `timeline` (testing.PacedTrainer) gives train_step spans without micro-batches
        self._trained = train_timing(began, time.time_ns(), self.trainer.version - 1,
                                     getattr(self.trainer, "timeline", ()))
        started = time.perf_counter()
        await self.strategy.before_weight_update()
        await self._sync_weights()
        await self.strategy.after_weight_update()
        metrics["perf/weight_sync_s"] = time.perf_counter() - started
        metrics["train/samples"] = float(len(samples))
        metrics["train/weight_version"] = float(self.trainer.version)
        return metrics

    async def _sync_weights(self) -> None:
        """The trainer's new weights into the engine: under `trainer.lora` its adapter alone, else every weight."""
        assert self.trainer is not None
        adapter = self.trainer.engine_adapter()
        if adapter is None:
            await self.engine.update_weights(self.trainer.engine_weights(), self.trainer.version)
        else:
            await self.engine.update_adapter(adapter, self.trainer.version)

    def _record(self, step: int, result: StepResult, metrics: dict[str, float]) -> None:
        """The step's replay bundle (after its checkpoint, so the bundle can name it), when one is wanted."""
        if self.recorder is None or not self.recorder.wants(step):
            return
        samples = train_samples(result.groups) if self.trainer is not None else []
        folder = self.checkpoints.folder if self.checkpoints is not None else None
        log.info("replay bundle: %s", self.recorder.record(step, result, samples, metrics, folder))

    def _engine_metrics(self) -> dict[str, float]:
        """The engine's `engine/...` metrics since the last call (prefill/decode time of the embedded engine,
        admission of engine=sglang); {} for an engine that reports none."""
        return self.engine.step_metrics()

    def _save(self, step: int) -> None:
        if self.trainer is None or self.checkpoints is None or not self.checkpoints.due(step, self.num_steps - 1):
            return
        self._write(step + 1)

    def _write(self, done: int) -> None:
        """Checkpoint `step_<done>` (weights, optimizer, data position), then prune to `keep_checkpoints`."""
        assert self.trainer is not None and self.checkpoints is not None
        path = self.checkpoints.folder / f"step_{done}"
        self.trainer.save(path, {"step": done, "data": self._data})
        self.saved = done
        log.info("checkpoint saved: %s (weights v%d)", path, self.trainer.version)
        for old in self.checkpoints.prune():
            log.info("checkpoint removed: %s (trainer.keep_checkpoints=%d)", old, self.checkpoints.keep)

    async def _resume(self) -> int:
        if self.trainer is None or self.checkpoints is None or not self.checkpoints.resume:
            return 0
        latest = self.checkpoints.latest()
        if latest is None:
            log.warning("trainer.resume=true but %s holds no checkpoint; starting from step 0",
                        self.checkpoints.folder)
            return 0
        extra = await asyncio.to_thread(self.trainer.load, latest)
        self.pipeline.source.restore(extra["data"])
        await self._sync_weights()
        log.info("resumed from %s at step %d (weights v%d)", latest, extra["step"], self.trainer.version)
        self.saved = int(extra["step"])
        return int(extra["step"])

    def _report(self) -> None:
        rewards = [m["rollout/raw_reward"] for m in self.history if "rollout/raw_reward" in m]
        if rewards:
            log.info("rollout/raw_reward first step %.4f, last step %.4f (over %d steps)", rewards[0], rewards[-1],
                     len(rewards))


def settle_garbage(full: bool = False) -> None:
    """Collect garbage, then freeze the survivors out of later collections (see the module); `full` first
    unfreezes earlier survivors, so their dead cycles are collected too."""
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, GC_OLDEST_THRESHOLD)


def train_samples(groups: list[Group]) -> list[Sample]:
    """The credited samples of every kept group (contexts with an advantage), in group order: the trainer's rows."""
    return [context.sample for group in groups if not group.excluded for context in group.contexts
            if context.advantage is not None]
