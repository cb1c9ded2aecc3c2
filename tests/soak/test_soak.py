"""The load soak as a test (`-m soak`, not in the default run): `bench/soak.py` for `RELAX_SOAK_MINUTES`
(default 10) must end with no error and the gateway's RSS within its growth limit from start to end.

    RELAX_SOAK_MINUTES=2 pytest -m soak tests/soak -s
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax_pipeline.config import REPO_ROOT

MINUTES = float(os.environ.get("RELAX_SOAK_MINUTES", "10"))


@pytest.mark.timeout(MINUTES * 60 + 600)
def test_64_sessions_by_32_turns_for_minutes_without_error_or_memory_growth() -> None:
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--minutes", str(MINUTES)],
                          capture_output=True, text=True, timeout=MINUTES * 60 + 600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines if "RSS" in line][:3] == ["start", "middle", "end"]
    assert " 0 errors" in lines[-1]
