"""A Ctrl-C as a terminal sends it, through the CLI: the outcome `interrupted`, one summary line, no tracebacks.

A terminal's Ctrl-C sends SIGINT to its whole foreground process group. The run is started in a process group of
its own and the signal goes to that group (`os.killpg`), as the terminal would. Its agents hold in step 1 (the
digits agent's gate) and are released right after the signal, so they call the gateway while the run stops:
the gateway must still answer them (uvicorn's own SIGINT handler once closed it under them, and each group was
then dropped with an agent's `Connection refused` traceback on stderr). The sessions of step 1 end `dropped`
with the outcome `interrupted`, their agents' logs stay in their session folders, and stderr carries the
stop's one summary line and the checkpoint line, no traceback and no agent output. The other outcomes are
produced by `tests/e2e/test_faults.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_stop_and_resume import overrides, read, wait_for


def test_a_terminal_ctrl_c_ends_the_running_sessions_interrupted_without_tracebacks(tmp_path: Path,
                                                                                      tiny_path: Path) -> None:
    work, hold = tmp_path, tmp_path / "sleep_in_step_1"
    hold.touch()
    out = work / "out"
    proc = subprocess.Popen([sys.executable, "-m", "relax_pipeline", *overrides(out, tiny_path, "job=rollout",
                                                                                "rollout.n_samples_per_prompt=4"),
                             f"hydra.run.dir={work}/hydra"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    started = wait_for(lambda: sorted((out / "sessions").glob("g1-*/started")), proc)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the run's whole foreground process group
    hold.unlink()  # the agents go on to call the gateway while the run stops
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "last output" not in stderr, stderr[-3000:]
    assert stderr.count("SIGINT: stopping;") == 1 and "dropped:" not in stderr, stderr[-3000:]
    rows = read(out / "dump" / "r_1.jsonl")
    assert rows and {(r["status"], r["outcome"], r["error"]) for r in rows} == {
        ("dropped", "interrupted", "interrupted by SIGINT")}
    assert {(r["group_id"], r["index"]) for r in rows} >= {tuple(p.parent.name.rsplit("-", 1)[:1]) + (
        int(p.parent.name.rsplit("-", 1)[1]),) for p in started}
    assert all((p.parent / "agent.log").exists() for p in started), "each agent's log stays in its session folder"
