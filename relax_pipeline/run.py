"""`run(cfg)`: the composed config as records, the job's recipe run, its metrics returned.

Jobs (one recipe each, `relax_pipeline/recipes/`): `train`, `rollout`, `eval`, `check`, `replay` and `view`.
`run` registers the schema, opens the run's output folder (`run.log`, `config.yaml`) and its stop signals, turns
the composed config into records (`config.records`, each checking its own keys) and checks what spans nodes
(`config.validate`), then hands the job's recipe a `Job` (the records, the folder, the resolved config, the
signals). `view` and `replay` write no folder: they run without run.log and without signals. Every step's metrics
also go to `metrics.jsonl` (`tracking/metrics_file.py`). `__main__` stays thin and tests call `run` in-process.

A failed run raises after saying why in one sentence, as its last line: `run failed: <why>` in run.log and on
stderr (the jobs without a folder write it to stderr only). A mistake in the input (a `ValueError` or a
`FileNotFoundError`, whose message names the key, the value and the fix) is that sentence as it is; any other
error is prefixed with its type.

Signals (`StopSignals`, main thread only): the first SIGINT or SIGTERM asks the step loop to stop
(`StepLoop.request_stop`: running sessions dropped, a checkpoint of the last finished step, then
`RunInterrupted`, logged as the last line with where the checkpoint is and how to resume; `__main__`
exits 130 or 143 without a traceback). A second one kills the running agents and exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from relax_pipeline.config import records, register, validate
from relax_pipeline.loop import RunInterrupted
from relax_pipeline.recipes import check, eval, replay, rollout, train, view
from relax_pipeline.recipes.parts import Job
from relax_pipeline.tracking.logs import run_logging, show_on_console

log = logging.getLogger("relax_pipeline")

RECIPES: dict[str, Callable[[Job], dict[str, float]]] = {
    "train": train.run, "rollout": rollout.run, "eval": eval.run, "check": check.run, "replay": replay.run,
    "view": view.run,
}
"""Each job's recipe."""
FOLDERLESS = ("view", "replay")
"""Jobs that write no output folder: `view` reads a run folder, `replay` re-runs a bundle on the CPU."""


def run(cfg: DictConfig) -> dict[str, float]:
    """Run the configured job; returns the last step's metrics (or the check's findings)."""
    register()
    if cfg.job in FOLDERLESS:
        return _folderless(cfg)
    output_dir = _output_dir(cfg)
    with run_logging(output_dir) as log_path, StopSignals() as signals:
        try:
            config = records(cfg)
            validate(config)
            show_on_console(config.tracking.console, config.tracking.console_metrics)
            (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            log.info("job=%s output_dir=%s log=%s", config.job, output_dir, log_path)
            resolved = OmegaConf.to_container(cfg, resolve=True)  # what the tracker records
            return RECIPES[config.job](Job(config, output_dir, resolved, signals))  # type: ignore[arg-type]
        except RunInterrupted as stop:
            log.warning("%s", stop)
            raise
        except BaseException as error:
            log.error("run failed: %s", one_sentence(error))
            raise


def _folderless(cfg: DictConfig) -> dict[str, float]:
    """`view` and `replay`: no run.log and no signals of ours; a failure's sentence goes to stderr."""
    try:
        config = records(cfg)
        validate(config)
        return RECIPES[config.job](Job(config))
    except Exception as error:
        sys.stderr.write(f"run failed: {one_sentence(error)}\n")
        raise


class StopSignals:
    """SIGINT and SIGTERM while a run is on: the first asks it to stop (on the event loop), the second kills
    the running agents and exits at once. Installed only in the main thread; the previous handlers come
    back on exit. A first signal that arrives before `attach` (while the model loads) is kept for it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: Callable[[int], None] = lambda signum: None
        self._kill: Callable[[], None] = lambda: None

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def attach(self, loop: asyncio.AbstractEventLoop, stop: Callable[[int], None], kill: Callable[[], None]) -> None:
        """From now on a first signal calls `stop(signum)` on `loop` and a second one calls `kill()` first."""
        self._loop, self._stop, self._kill = loop, stop, kill
        if self.signum is not None:
            loop.call_soon(stop, self.signum)

    def detach(self) -> None:
        self._loop = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            sys.stderr.write(f"\n{name} again: killing the running agents and exiting now, without a checkpoint\n")
            self._kill()
            os._exit(128 + signum)
        self.signum = signum
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, signum)
        else:
            sys.stderr.write(f"\n{name}: the run stops once start-up is done (send it again to exit now)\n")


def _output_dir(cfg: DictConfig) -> Path:
    if cfg.get("output_dir"):
        return Path(cfg.output_dir).expanduser().resolve()
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:
        return Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def one_sentence(error: BaseException) -> str:
    """The failure line's text: an input mistake's own message (it names the key, the value and the fix), any
    other error's first line after its type."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    named = isinstance(error, ValueError | FileNotFoundError)  # our own messages already name the key
    return text if named else f"{type(error).__name__}: {text}"
