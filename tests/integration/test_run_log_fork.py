"""run.log across a fork (`tracking/logs.py`): a child never writes the parent's buffered lines a second time, and
its own lines reach the file though it has no flusher thread."""

from __future__ import annotations

import logging
from pathlib import Path

from relax_pipeline.tracking.logs import ACCESS_LOGGER, run_logging


def test_a_forked_child_writes_no_line_twice(tmp_path: Path) -> None:
    import os

    with run_logging(tmp_path) as path:
        access = logging.getLogger(ACCESS_LOGGER)
        access.info("api=chat session=before status=200")
        pid = os.fork()
        if pid == 0:  # the child: one line of its own, then out without the parent's buffer
            access.info("api=chat session=child status=200")
            os._exit(0)
        os.waitpid(pid, 0)
        access.info("api=chat session=after status=200")
    sessions = [line.split("session=")[1].split()[0] for line in path.read_text().splitlines()]
    assert sorted(sessions) == ["after", "before", "child"]
