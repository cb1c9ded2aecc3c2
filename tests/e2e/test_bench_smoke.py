"""Every benchmark runs: each `bench/*.py` as a new user runs it, with `--smoke` (tiny sizes, a few seconds).

A bench is a script nobody imports, so nothing else notices when one stops running (`bench/runtime_modes.py` once
failed at start for a release after `conf/` moved into the package). Each script here runs in its own interpreter
from the repository root with `--smoke` (`bench/_smoke.py`); the test checks that it exits 0 and printed its
headline line, the one that carries the figure the bench exists for. No figure is checked: smoke sizes say nothing
about speed. A script whose extra is not installed skips, naming the extra (CI makes that skip a failure).

The scripts run `AT_ONCE` at a time (started by the first test that asks, in a module-scoped fixture): much of a
smoke run is waiting (a Ray cluster or an SGLang-wire server starting, agents sleeping), so the eleven take about
a minute together on 2 cores instead of two one after another.

A new bench must add its headline to `HEADLINES` (`test_every_bench_has_a_headline` fails until it does).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.name for path in (REPO / "bench").glob("*.py") if not path.name.startswith("_"))
HEADLINES = {
    "admission.py": r"^steps 1\+ \(median\), program / none: re-prefilled sessions [\d.]+/[\d.]+, step time \d+\.\d+x",
    "agents_ray.py": r"^Ray overhead per session: [-+]\d",
    "engine.py": r"prefix cache speed-up \d+\.\d+x",
    "engine_sglang.py": r"^ratio ours/server \d+\.\d+x",
    "forest.py": r"^turn-64 / turn-1 cost ratio: \d",
    "forest_memory.py": r"^tuples / compact bytes per token: \d",
    "house.py": r"^files a chat turn runs: first \d+, second \d+$",
    "gateway.py": r"^ours / bare CPU per request, .*: \d+\.\d+x",
    "learning.py": r"^mean step \d+\.\d s",
    "runtime_modes.py": r"^fully_async +\d.* \d+\.\d+x +\d+% +\d+\.\d%$",
    "soak.py": r"^waves \d+ .* requests, 0 errors",
    "train_step.py": r"^ratio ours / bare +\d+\.\d+",
    "view.py": r"naive / ours \(cold open\) = \d+\.\d+x",
}
"""Each bench's headline line (a regular expression over its output's lines)."""
NEEDS = {"agents_ray.py": ("ray", "ray"), "engine_sglang.py": ("smg", "router")}
"""bench → (module, extra): the extra a bench needs beyond the test extra."""
SECONDS = 240
"""A smoke run that takes longer than this is stuck (each takes 3-25 s on 2 busy cores)."""
AT_ONCE = 3
"""Smoke runs at the same time."""


def missing_extra(bench: str) -> str | None:
    """Why `bench` cannot run here (its extra is not installed, named), or None."""
    module, extra = NEEDS.get(bench, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        return f"bench/{bench} needs {module}: pip install -e '.[{extra}]'"
    return None


def smoke(bench: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "bench" / bench), "--smoke"], cwd=REPO, capture_output=True,
                          text=True, timeout=SECONDS)


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[subprocess.CompletedProcess[str]]]]:
    """The smoke run of every bench this session tests and can run, started `AT_ONCE` at a time."""
    selected = [item.callspec.params["bench"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bench_runs_in_smoke_mode"]
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        yield {bench: pool.submit(smoke, bench) for bench in selected if missing_extra(bench) is None}


def test_every_bench_has_a_headline() -> None:
    missing = sorted(set(BENCHES) - set(HEADLINES))
    assert not missing, f"add each new bench's headline line to HEADLINES in {Path(__file__).name}: {missing}"
    gone = sorted(set(HEADLINES) - set(BENCHES))
    assert not gone, f"HEADLINES names benches that are gone: {gone}"


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_runs_in_smoke_mode(bench: str, smoke_runs: dict[str, Future[subprocess.CompletedProcess[str]]]
                                  ) -> None:
    if (reason := missing_extra(bench)) is not None:
        pytest.skip(reason)
    done = smoke_runs[bench].result()
    output = f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"bench/{bench} --smoke exited {done.returncode}\n{output}"
    headline = re.compile(HEADLINES[bench], re.MULTILINE)
    assert headline.search(done.stdout), f"bench/{bench} printed no line matching {headline.pattern!r}\n{output}"
