"""run.log (`tracking/logs.py`): every line reaches the file with the text `logging.Formatter(FORMAT)` writes;
warnings at once, INFO lines by the flusher within its interval, and everything on close."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

from relax_pipeline.tracking.logs import ACCESS_LOGGER, FORMAT, RunLogFile, RunLogFormatter, run_logging, write_info


def _record(created: float, level: int = logging.INFO, message: str = "api=%s status=%d") -> logging.LogRecord:
    record = logging.LogRecord(ACCESS_LOGGER, level, __file__, 1, message, ("chat", 200), None)
    record.created, record.msecs = created, (created - int(created)) * 1000
    return record


def test_formatter_writes_what_logging_writes() -> None:
    ours, theirs = RunLogFormatter(), logging.Formatter(FORMAT)
    start = time.time()
    for k in range(3000):
        record = _record(start + k * 0.0137, logging.WARNING if k % 7 == 0 else logging.INFO)
        assert ours.format(record) == theirs.format(record)
    assert ours.formatTime(_record(start), "%H") == theirs.formatTime(_record(start), "%H")


def test_warnings_reach_the_file_at_once_and_info_lines_within_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    handler = RunLogFile(path, interval=0.2)
    handler.setFormatter(RunLogFormatter())
    try:
        handler.handle(_record(time.time()))
        handler.handle(_record(time.time(), logging.WARNING, "refused %s %d"))
        assert path.read_text().count(ACCESS_LOGGER) == 2  # the warning flushed the INFO line before it too
        handler.handle(_record(time.time(), message="later %s %d"))
        deadline = time.monotonic() + 10
        while "later chat 200" not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "later chat 200" in path.read_text()
    finally:
        handler.close()


def test_a_clean_stop_loses_no_line(tmp_path: Path) -> None:
    with run_logging(tmp_path) as path:
        access = logging.getLogger(ACCESS_LOGGER)
        for k in range(500):
            access.info("api=chat session=s%d status=200", k)
    lines = path.read_text().splitlines()
    assert [line.rsplit("session=", 1)[1] for line in lines] == [f"s{k} status=200" for k in range(500)]
    assert all(f" INFO {ACCESS_LOGGER}: api=chat" in line for line in lines)


@contextlib.contextmanager
def plain_root() -> Iterator[None]:
    """The root logger without pytest's capture handlers (added for each test's call), as in a run's process."""
    root = logging.getLogger()
    kept, root.handlers = root.handlers, []
    try:
        yield
    finally:
        root.handlers = kept


def test_write_info_writes_the_line_logging_writes_and_loses_none(tmp_path: Path) -> None:
    with plain_root(), run_logging(tmp_path) as path:
        access = logging.getLogger(ACCESS_LOGGER)
        access.info("api=chat session=%s status=%d", "s-logged", 200)
        for k in range(300):
            assert write_info(access, f"api=chat session=s{k} status=200")
    logged, *direct = path.read_text().splitlines()
    assert len(direct) == 300 and direct[-1].endswith(f" INFO {ACCESS_LOGGER}: api=chat session=s299 status=200")
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
    assert all(stamp.match(line) for line in (logged, *direct))
    assert stamp.sub("", direct[0]).replace("s0", "s-logged") == stamp.sub("", logged)


def test_write_info_leaves_the_line_to_logging_where_anything_else_would_see_it(tmp_path: Path) -> None:
    seen: list[logging.LogRecord] = []
    other = logging.Handler()
    other.emit = seen.append  # type: ignore[method-assign]
    access = logging.getLogger(ACCESS_LOGGER)
    with plain_root(), run_logging(tmp_path) as path:
        logging.getLogger().addHandler(other)  # a user's handler, or pytest's caplog
        try:
            assert not write_info(access, "api=chat session=s1 status=200")
        finally:
            logging.getLogger().removeHandler(other)
        access.addFilter(lambda record: True)  # a filter may drop or change the record: logging decides
        try:
            assert not write_info(access, "api=chat session=s2 status=200")
        finally:
            access.filters.clear()
        assert write_info(access, "api=chat session=s3 status=200")
    with plain_root():
        assert not write_info(access, "api=chat session=s4 status=200")  # no run.log at all
    assert "session=s1" not in path.read_text() and "session=s3" in path.read_text() and not seen
