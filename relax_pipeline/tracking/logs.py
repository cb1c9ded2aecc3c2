"""Run logging: everything the run logs goes to the console and to `run.log` in the output folder.

`run_logging` installs the handlers for one run and removes them afterwards, so in-process runs
(tests) do not leak handlers into each other. Third-party loggers that chatter per request (httpx,
uvicorn access) are kept at WARNING.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("httpx", "httpcore", "uvicorn.access", "urllib3", "filelock")
ACCESS_LOGGER = "relax_pipeline.gateway.access"
"""The gateway's one line per model request: in run.log always, on the console only at WARNING."""


def _not_access_info(record: logging.LogRecord) -> bool:
    return record.name != ACCESS_LOGGER or record.levelno >= logging.WARNING


@contextlib.contextmanager
def run_logging(output_dir: Path) -> Iterator[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "run.log"
    root = logging.getLogger()
    handlers = [logging.FileHandler(path, encoding="utf-8"), logging.StreamHandler()]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    handlers[1].addFilter(_not_access_info)
    previous = root.level
    root.setLevel(logging.INFO)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield path
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(previous)
