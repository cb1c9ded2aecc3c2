"""The console at a glance: one headline line per step, and progress bars that never split a log line.

The step loop logs one record per step (`step N metrics k=v ...`, every metric) and one per eval, each carrying its
metrics as a `Progress` (`logger.info(..., extra=step_progress(...))`). `run.log` writes them as they are (design
§3.4). The console (`ConsoleHandler`, installed by `tracking/logs.py`'s `run_logging`) writes, under
`tracking.console=headline` (the default), the step's record as one headline instead:

    step 18/20 · reward 0.867 · eval heldout 0.74 · loss 1.8e-08 · 2.6 s/step · eta 0:05

`step k/N`: k steps done of N (run.log's `step k-1 metrics`); then each `tracking.console_metrics` entry the step
has (`label:metric`, or a bare metric name labelled by its path less the first segment; a `*` stands for one path
segment, its match added to the label), the step's time and the time left at the mean of the last `ETA_STEPS`
steps. An eval's record becomes `eval after k steps · heldout
0.74`, and the per-step detail lines (`DETAIL`: the accounting and eval-end lines) stay in run.log only.
`tracking.console=full` writes every line run.log gets, each headline after its step's line.

Every console line is written through `tqdm.write`, which clears the progress bars on the same stream, writes the
line and draws them again: a bar never ends up inside a line, and a warning or an error stands on a line of its
own. What it does not do: write run.log, choose colours, or read the terminal's width.
"""

from __future__ import annotations

import logging
import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tqdm import tqdm

PROGRESS = "relax_progress"
"""The record attribute that carries a `Progress`."""
HEADLINE, FULL = "headline", "full"
MODES = (HEADLINE, FULL)
"""`tracking.console`'s values."""
DETAIL = ("AGENTIC ROLLOUT ", "AGENTIC EVAL ")
"""INFO lines kept off the console under `headline` (the headline holds what a person watches; run.log holds
them)."""
CONSOLE_METRICS = ("reward:rollout/raw_reward", "eval:eval/*/raw_reward", "loss:train/loss")
"""`tracking.console_metrics`' default: the mean reward, each eval dataset's, the training loss."""
ETA_STEPS = 5
"""Steps whose mean time estimates the time left."""
SEPARATOR = " · "


@dataclass(frozen=True)
class Progress:
    """A step's or an eval's metrics, carried by its log record; connects loop.py's records to the console."""

    done: int
    """Steps finished."""
    steps: int | None
    """The run's `rollout.num_steps`; None on an eval's record."""
    metrics: Mapping[str, float]
    """Every metric of the step, with the latest eval's (`eval/...`); an eval's own metrics on an eval's record."""


def step_progress(done: int, steps: int, metrics: Mapping[str, float]) -> dict[str, Progress]:
    """`extra=` for a step's record: `done` steps of `steps` finished, with these metrics."""
    return {PROGRESS: Progress(done, steps, dict(metrics))}


def eval_progress(done: int, metrics: Mapping[str, float]) -> dict[str, Progress]:
    """`extra=` for an eval's record, the eval run after `done` steps."""
    return {PROGRESS: Progress(done, None, dict(metrics))}


class Headline:
    """Renders `Progress` as one line: the chosen metrics (`label:name`, in order), time per step, ETA."""

    def __init__(self, metrics: Sequence[str]) -> None:
        self.patterns = [(label, _pattern(name)) for label, name in map(labelled, metrics)]
        self._times: deque[float] = deque(maxlen=ETA_STEPS)

    def render(self, progress: Progress) -> str:
        if progress.steps is None:
            return self._eval(progress)
        parts = [f"step {progress.done}/{progress.steps}", *self._figures(progress.metrics, eval_only=False)]
        seconds = progress.metrics.get("perf/step_time")
        if seconds is not None and math.isfinite(seconds):
            self._times.append(seconds)
            parts.append(f"{_seconds(seconds)} s/step")
        left = progress.steps - progress.done
        if self._times and left > 0:
            parts.append(f"eta {_clock(left * sum(self._times) / len(self._times))}")
        return SEPARATOR.join(parts)

    def _eval(self, progress: Progress) -> str:
        figures = self._figures(progress.metrics, eval_only=True)
        steps = "step" if progress.done == 1 else "steps"
        return SEPARATOR.join([f"eval after {progress.done} {steps}", *(figures or ["metrics in run.log"])])

    def _figures(self, metrics: Mapping[str, float], eval_only: bool) -> list[str]:
        """`label value` for every metric a pattern matches, in the patterns' order; an eval's line names only
        the matched segment (`heldout 0.74`)."""
        out = []
        for label, pattern in self.patterns:
            if eval_only and not pattern.pattern.startswith("eval/"):
                continue
            for name, value in metrics.items():
                if (found := pattern.fullmatch(name)) is not None:
                    words = [*found.groups()] if eval_only and found.groups() else [label, *found.groups()]
                    out.append(f"{' '.join(words)} {_figure(value)}")
        return out


class ConsoleFormatter(logging.Formatter):
    """A step's or an eval's record as its headline (under `full`, after its line as `base` writes it); every other
    record as `base` writes it."""

    def __init__(self, base: logging.Formatter, headline: Headline, full: bool = False) -> None:
        super().__init__()
        self.base, self.headline, self.full = base, headline, full

    def format(self, record: logging.LogRecord) -> str:
        progress = getattr(record, PROGRESS, None)
        if not isinstance(progress, Progress):
            return self.base.format(record)
        line = self.headline.render(progress)
        return f"{self.base.format(record)}\n{line}" if self.full else line


class ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg] - the stream is stderr's TextIO
    """The run's console: each line written through `tqdm.write` (clear the bars, write, draw them again)."""

    def __init__(self, base: logging.Formatter, metrics: Sequence[str], mode: str = HEADLINE) -> None:
        super().__init__()
        self.base = base
        self.configure(metrics, mode)
        self.addFilter(self._shown)

    def configure(self, metrics: Sequence[str], mode: str) -> None:
        """Show `metrics` in each step's headline; `mode` is `tracking.console` (headline or full)."""
        check_console(mode, metrics)
        self.mode = mode
        self.setFormatter(ConsoleFormatter(self.base, Headline(metrics), full=mode == FULL))

    def _shown(self, record: logging.LogRecord) -> bool:
        """Under headline, the per-step detail lines (`DETAIL`) stay off the console."""
        if self.mode == FULL or record.levelno > logging.INFO or not isinstance(record.msg, str):
            return True
        return not record.msg.startswith(DETAIL)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own contract: a failed line is reported, never raised
            self.handleError(record)


def check_console(mode: str, metrics: Sequence[str]) -> None:
    """`tracking.console` and `tracking.console_metrics` as the console takes them; a ValueError naming the key."""
    if mode not in MODES:
        raise ValueError(f"tracking.console={mode!r} is not one of {', '.join(MODES)}: headline shows one line per "
                         "step, full also every line run.log gets")
    if isinstance(metrics, str):
        raise ValueError(f"tracking.console_metrics={metrics!r} is not a list: write "
                         "tracking.console_metrics=[reward:rollout/raw_reward,loss:train/loss]")
    for entry in metrics:
        label, name = labelled(str(entry))
        if not label.strip() or not name.strip() or "**" in name or " " in name:
            raise ValueError(f"tracking.console_metrics entry {entry!r} is not `label:metric` or a metric name: "
                             "write e.g. reward:rollout/raw_reward (a `*` stands for one path segment: "
                             "eval:eval/*/raw_reward)")


def labelled(entry: str) -> tuple[str, str]:
    """(label, metric name) of a `tracking.console_metrics` entry: `label:name`, or a bare name labelled by its path
    less the first segment (`train/ppo_kl` → `ppo_kl`)."""
    label, colon, name = entry.partition(":")
    if colon:
        return label, name
    rest = entry.split("/", 1)[1] if "/" in entry else entry
    return "/".join(piece for piece in rest.split("/") if piece != "*") or entry, entry


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile("".join("([^/]+)" if piece == "*" else re.escape(piece) for piece in re.split(r"(\*)", name)))


def _figure(value: float) -> str:
    """3 significant digits (0.867, 1.8e-08); whole numbers from 100 up as they are (1234)."""
    if math.isfinite(value) and 100 <= abs(value) < 1e6:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def _clock(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour up."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"

