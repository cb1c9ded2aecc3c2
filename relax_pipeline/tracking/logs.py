"""Run logging: everything the run logs goes to `run.log` in the output folder, and to the console at a glance.

`run_logging` installs the handlers for one run and removes them afterwards, so in-process runs
(tests) do not leak handlers into each other. Third-party loggers that chatter per request (httpx,
uvicorn access) are kept at WARNING, and transformers' own progress bars (one per model load) are off.
The console is `tracking/console.py`'s `ConsoleHandler`: one headline line per step, the rest of run.log's lines
but the per-step detail ones, progress bars that never split a line; `show_on_console` applies
`tracking.console` and `tracking.console_metrics` to it once the config is read.

`run.log` is written by `RunLogFile`: a line is formatted and written as it is logged, every warning and error is
flushed to the file at once, and INFO lines (the gateway's access line per model request above all: a flush is a
system call, about a fifth of that line's cost) are flushed with the next line logged after `FLUSH_S`, by a
background thread at most `FLUSH_S` after they were written, when the buffer fills, and when the handler closes (the
run's end, `logging.shutdown` at exit). So a clean stop loses nothing; a process killed outright (SIGKILL, a crash
of the interpreter) loses at most the INFO lines of its last `FLUSH_S`. The console still writes each line at once.
A fork flushes every `RunLogFile` first (a child never inherits buffered lines to write a second time), and in the
child, which has no flusher thread, each line is flushed as it is written.
`RunLogFormatter` writes `FORMAT` exactly as `logging.Formatter` does, making each second's date text once.

`write_info` is the gateway's access line's short way into run.log (a `LogRecord`, the handler chain, its locks and
filters and `Formatter.format` cost about as much CPU as the rest of the line's request's HTTP handling): where the
only handlers the line would reach are `run_logging`'s own (run.log, and a console that drops INFO access lines),
it writes the same text straight into run.log's buffer, under its lock and with its flush policy. Anywhere else (a
user's handler, pytest's `caplog`, a filter on a logger, another format) the caller logs the record as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from relax_pipeline.tracking.console import CONSOLE_METRICS, HEADLINE, ConsoleHandler

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("httpx", "httpcore", "uvicorn.access", "urllib3", "filelock")
ACCESS_LOGGER = "relax_pipeline.gateway.access"
"""The gateway's one line per model request: in run.log always, on the console only at WARNING."""
FLUSH_S = 0.5
"""The longest an INFO line waits in `run.log`'s buffer (a warning or error is flushed at once)."""


def _not_access_info(record: logging.LogRecord) -> bool:
    return record.name != ACCESS_LOGGER or record.levelno >= logging.WARNING


class RunLogFormatter(logging.Formatter):
    """`logging.Formatter(FORMAT)`, the same text, with the date part of `asctime` made once per second."""

    def __init__(self, fmt: str = FORMAT) -> None:
        super().__init__(fmt)
        self._second: tuple[int, str] = (-1, "")
        """(epoch second, its date text): one tuple, so a thread never reads one second with another's text."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return self.stamp(record.created, record.msecs)

    def stamp(self, created: float, msecs: float) -> str:
        """`asctime` of a record made at `created` (`msecs`: its milliseconds, as `LogRecord` computes them)."""
        second, text = self._second
        if int(created) != second:
            text = time.strftime(self.default_time_format, self.converter(created))
            self._second = (int(created), text)
        return self.default_msec_format % (text, msecs)

    def line(self, levelname: str, name: str, message: str) -> str:
        """`FORMAT`'s text of a record logged now (what `format` writes for it; no exception or stack)."""
        created = time.time()
        return f"{self.stamp(created, int((created - int(created)) * 1000) + 0.0)} {levelname} {name}: {message}"


class RunLogFile(logging.FileHandler):
    """`run.log`: warnings and errors flushed at once, INFO lines within `interval` seconds (see the module)."""

    def __init__(self, path: Path, interval: float = FLUSH_S) -> None:
        super().__init__(path, encoding="utf-8")
        self.interval = interval
        _OPEN.add(self)
        self._flushed = time.monotonic()
        self._dirty = False
        self._closing = threading.Event()
        self._flusher = threading.Thread(target=self._flush_late, name="run-log-flush", daemon=True)
        self._flusher.start()

    def emit(self, record: logging.LogRecord) -> None:
        """Write the line; flush it now if it is a warning or worse or the last flush is `interval` old."""
        if record.levelno >= logging.WARNING:
            super().emit(record)  # writes and flushes
            self._flushed, self._dirty = time.monotonic(), False
            return
        try:
            self._write(self.format(record))
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own contract: a failed line is reported, never raised
            self.handleError(record)

    def write_info(self, line: str) -> None:
        """An INFO line already formatted, written as `emit` writes one (under the handler's lock, as `handle` takes
        it for `emit`)."""
        with self.lock:  # type: ignore[union-attr] - a Handler always has its lock after __init__
            try:
                self._write(line)
            except Exception:  # noqa: BLE001 - logging's own contract: a failed line is reported, never raised
                self.handleError(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def _write(self, line: str) -> None:
        """An INFO line into the buffer, flushed now only when the last flush is `interval` old."""
        if self.stream is None:
            self.stream = self._open()
        self.stream.write(line + self.terminator)
        if time.monotonic() - self._flushed >= self.interval:
            self.flush()
            self._flushed, self._dirty = time.monotonic(), False
        else:
            self._dirty = True

    def _flush_late(self) -> None:
        """The flusher thread: INFO lines left in the buffer reach the file within `interval`."""
        while not self._closing.wait(self.interval):
            if self._dirty:
                with self.lock:  # type: ignore[union-attr] - a Handler always has its lock after __init__
                    self._dirty = False
                    self.flush()
                self._flushed = time.monotonic()

    def close(self) -> None:
        self._closing.set()
        if self._flusher is not threading.current_thread():
            self._flusher.join()
        super().close()  # flushes what is left


_OPEN: weakref.WeakSet[RunLogFile] = weakref.WeakSet()
"""Every `RunLogFile` not yet collected, for the fork hooks."""


def _before_fork() -> None:
    for handler in list(_OPEN):
        handler.flush()


def _in_child() -> None:
    for handler in list(_OPEN):
        handler.interval = 0.0  # no flusher thread in a forked child: every line is flushed as it is written


os.register_at_fork(before=_before_fork, after_in_child=_in_child)


def write_info(logger: logging.Logger, message: str) -> bool:
    """Write `message` as `logger.info(message)` would into run.log when only `run_logging`'s handlers would see it
    (see the module); False, writing nothing, otherwise. The caller has checked `logger.isEnabledFor(INFO)`."""
    target = _sole_run_log(logger)
    if target is None:
        return False
    target.write_info(target.formatter.line("INFO", logger.name, message))  # type: ignore[union-attr]
    return True


def _sole_run_log(logger: logging.Logger) -> RunLogFile | None:
    """The `RunLogFile` that alone would write an INFO record of `logger` (`run_logging`'s, formatting `FORMAT`),
    else None: a filter on the way, another handler that would take the record, another formatter."""
    found: RunLogFile | None = None
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return None
        for handler in current.handlers:
            if type(handler) is RunLogFile and found is None and _plain(handler):
                found = handler
            elif handler.level <= logging.INFO and not _drops_access_info(handler, logger.name):
                return None
        current = current.parent if current.propagate else None
    return found


def _plain(handler: logging.Handler) -> bool:
    formatter = handler.formatter
    return (handler.level <= logging.INFO and not handler.filters and type(formatter) is RunLogFormatter
            and formatter._fmt == FORMAT)


def _drops_access_info(handler: logging.Handler, name: str) -> bool:
    """`run_logging`'s console: its filter drops every INFO line of the access logger."""
    return name == ACCESS_LOGGER and _not_access_info in handler.filters


@contextlib.contextmanager
def run_logging(output_dir: Path) -> Iterator[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "run.log"
    root = logging.getLogger()
    run_log = RunLogFile(path)
    run_log.setFormatter(RunLogFormatter())
    console = ConsoleHandler(RunLogFormatter(), CONSOLE_METRICS, HEADLINE)
    console.addFilter(_not_access_info)
    handlers: list[logging.Handler] = [run_log, console]
    for handler in handlers:
        root.addHandler(handler)
    previous = root.level
    root.setLevel(logging.INFO)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    bars = _hf_bars(False)
    try:
        yield path
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(previous)
        if bars:
            _hf_bars(True)


def show_on_console(mode: str, metrics: Sequence[str]) -> None:
    """Apply `tracking.console` (headline or full) and `tracking.console_metrics` to the console `run_logging`
    installed (nothing without one); a ValueError naming the key for a bad value."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ConsoleHandler):
            handler.configure(metrics, mode)


def _hf_bars(on: bool) -> bool:
    """Turn transformers' progress bars on or off when it is imported; returns whether they were on."""
    hf = sys.modules.get("transformers.utils.logging")
    if hf is None:
        return False
    was = bool(hf.is_progress_bar_enabled())
    if on:
        hf.enable_progress_bar()
    else:
        hf.disable_progress_bar()
    return was
