"""The console at a glance (`tracking/console.py`): a step's record renders as one headline (the chosen metrics, time
per step, ETA), an eval's as its datasets' figures, other records as run.log writes them; under headline the per-step
detail lines stay off the console; a log line written while a progress bar is drawn stands on a line of its own,
the bar drawn again below it; bad `tracking.console*` values are refused naming the key."""

from __future__ import annotations

import io
import logging
import re

import pytest
from tqdm import tqdm

from relax_pipeline.testing.terminal import screen
from relax_pipeline.tracking import console as c
from relax_pipeline.tracking.logs import FORMAT, RunLogFormatter, run_logging, show_on_console
from relax_pipeline.tracking.tracker import TrackingSettings

STEP = {"rollout/raw_reward": 0.86712, "train/loss": 1.8e-08, "perf/step_time": 2.61, "eval/heldout/raw_reward": 0.74,
        "eval/val/raw_reward": 0.5, "train/kl": 0.0012}


def record(message: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("relax_pipeline", level, __file__, 1, message, (), None)
    made.__dict__.update(extra)
    return made


def test_a_step_renders_as_one_headline_with_the_chosen_metrics_time_and_eta() -> None:
    headline = c.Headline(c.CONSOLE_METRICS)
    line = headline.render(c.Progress(18, 20, STEP))
    assert line == ("step 18/20 · reward 0.867 · eval heldout 0.74 · eval val 0.5 · loss 1.8e-08 · 2.6 s/step · "
                    "eta 0:05")
    assert headline.render(c.Progress(20, 20, STEP | {"perf/step_time": 12.4})).endswith("· 12 s/step"), "no eta"


def test_the_eta_is_the_mean_of_the_last_steps_times_the_steps_left() -> None:
    headline = c.Headline([])
    for done, seconds in enumerate([100.0] + [10.0] * c.ETA_STEPS, start=1):
        line = headline.render(c.Progress(done, 1000, {"perf/step_time": seconds}))
    assert c.ETA_STEPS == 5 and line.endswith("· 10 s/step · eta 2:45:40"), line  # 994 steps × 10 s: the first,
    # slow step no longer counts


def test_chosen_metrics_in_their_order_a_missing_one_left_out() -> None:
    line = c.Headline(["train/kl", "pass:passrate", "R:rollout/raw_reward"]).render(c.Progress(1, 2, STEP))
    assert line == "step 1/2 · kl 0.0012 · R 0.867 · 2.6 s/step · eta 0:03"
    assert [c.labelled(e) for e in ("train/kl", "passrate", "eval/*/raw_reward", "a:b/c")] == [
        ("kl", "train/kl"), ("passrate", "passrate"), ("raw_reward", "eval/*/raw_reward"), ("a", "b/c")]


def test_an_eval_renders_its_datasets_figures() -> None:
    headline = c.Headline(c.CONSOLE_METRICS)
    evals = {k: v for k, v in STEP.items() if k.startswith("eval/")}
    assert headline.render(c.Progress(4, None, evals)) == "eval after 4 steps · heldout 0.74 · val 0.5"
    assert c.Headline(["r:rollout/raw_reward"]).render(c.Progress(4, None, evals)) == (
        "eval after 4 steps · metrics in run.log")


def test_figures_read_at_a_glance() -> None:
    assert [c._figure(v) for v in (0.86712, 1.8e-08, -0.00647, 64.0, 1234.4, 3e7, float("nan"))] == [
        "0.867", "1.8e-08", "-0.00647", "64", "1234", "3e+07", "nan"]
    assert [c._clock(s) for s in (5.2, 65, 3725)] == ["0:05", "1:05", "1:02:05"]


def test_the_formatter_writes_the_headline_or_under_full_the_line_then_the_headline() -> None:
    base = RunLogFormatter()
    step = record("step %d metrics %s", **c.step_progress(1, 2, STEP))
    step.args = (0, "rollout/raw_reward=0.8671")
    plain = c.ConsoleFormatter(base, c.Headline(c.CONSOLE_METRICS))
    assert plain.format(step).startswith("step 1/2 · reward 0.867")
    full = c.ConsoleFormatter(base, c.Headline(c.CONSOLE_METRICS), full=True).format(step).split("\n")
    assert full[0].endswith("INFO relax_pipeline: step 0 metrics rollout/raw_reward=0.8671")
    assert full[1].startswith("step 1/2 · reward 0.867")
    assert plain.format(record("checkpoint saved: x")).endswith(" INFO relax_pipeline: checkpoint saved: x")


def test_headline_keeps_the_per_step_detail_lines_off_the_console_and_full_shows_them() -> None:
    stream = io.StringIO()
    handler = c.ConsoleHandler(RunLogFormatter(), c.CONSOLE_METRICS)
    handler.setStream(stream)
    detail = record("AGENTIC ROLLOUT event=accounting_end rollout=0 groups=2")
    warned = record("AGENTIC ROLLOUT something odd", logging.WARNING)
    for made in (detail, warned, record("checkpoint saved: x")):
        handler.handle(made)
    assert "accounting_end" not in stream.getvalue() and "something odd" in stream.getvalue()
    handler.configure(c.CONSOLE_METRICS, c.FULL)
    handler.handle(detail)
    assert "accounting_end" in stream.getvalue()


def test_a_line_logged_while_a_bar_is_drawn_stands_on_its_own_line() -> None:
    stream = io.StringIO()
    handler = c.ConsoleHandler(RunLogFormatter(), c.CONSOLE_METRICS)
    handler.setStream(stream)
    with tqdm(total=8, desc="step 1/2", unit=" scored", file=stream, leave=False, mininterval=0) as bar:
        bar.update(3)
        handler.handle(record("a warning from the gateway", logging.WARNING))
        bar.update(1)
        drawn = screen(stream.getvalue())
        handler.handle(record("step %d metrics %s", **c.step_progress(1, 2, STEP)))
        bar.update(4)
    shown = screen(stream.getvalue())  # the bar is cleared when it closes (leave=False)
    warning = next(line for line in shown if "a warning from the gateway" in line)
    assert re.fullmatch(r"\S+ \S+ WARNING relax_pipeline: a warning from the gateway", warning), warning
    assert re.fullmatch(r"step 1/2: +\d+%\|.*[34]/8 .*scored.*", drawn[-1]) and warning in drawn[:-1], "bar below"
    assert [line for line in shown if "·" in line] == ["step 1/2 · reward 0.867 · eval heldout 0.74 · eval val 0.5 · "
                                                      "loss 1.8e-08 · 2.6 s/step · eta 0:03"]


def test_run_logging_installs_the_console_and_show_on_console_configures_it(tmp_path, capsys) -> None:  # noqa: ANN001
    log = logging.getLogger("relax_pipeline.test_console")
    with run_logging(tmp_path):
        show_on_console(c.HEADLINE, ["R:rollout/raw_reward"])
        log.info("step %d metrics %s", 0, "rollout/raw_reward=0.8671", extra=c.step_progress(1, 2, STEP))
        log.info("AGENTIC ROLLOUT event=accounting_end rollout=0")
    assert capsys.readouterr().err.splitlines() == ["step 1/2 · R 0.867 · 2.6 s/step · eta 0:03"]
    written = (tmp_path / "run.log").read_text().splitlines()
    assert written[0].endswith(" INFO relax_pipeline.test_console: step 0 metrics rollout/raw_reward=0.8671")
    assert written[1].endswith("AGENTIC ROLLOUT event=accounting_end rollout=0") and len(written) == 2
    assert FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s", "run.log's lines as design §3.4 has them"


@pytest.mark.parametrize("settings, message", [
    ({"console": "loud"}, "tracking.console='loud' is not one of headline, full"),
    ({"console_metrics": ["reward:"]}, "tracking.console_metrics entry 'reward:' is not `label:metric` or a metric"),
    ({"console_metrics": "train/loss"}, "tracking.console_metrics='train/loss' is not a list"),
])
def test_bad_console_settings_are_refused_naming_the_key(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrackingSettings(**settings)
