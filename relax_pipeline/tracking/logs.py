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


@contextlib.contextmanager
def run_logging(output_dir: Path) -> Iterator[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "run.log"
    root = logging.getLogger()
    handlers = [logging.FileHandler(path, encoding="utf-8"), logging.StreamHandler()]
    for handler in handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
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
