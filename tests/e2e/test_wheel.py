"""The package installs as a wheel: config groups and the built-in examples ship inside it.

Builds the wheel from a copy of this checkout (without local build leftovers such as an egg-info, which can
make a broken package-data rule look fine), installs it non-editable into a fresh virtual environment (its
dependencies come from the test run's own environment through a `.pth` line, so nothing is downloaded
and the checkout's editable install is not visible there), and runs `python -m relax_pipeline job=check`
from an empty directory.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from relax_pipeline.config import REPO_ROOT

SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "outputs", "multirun")
"""What a fresh checkout lacks: a wheel built here must not lean on a local build's leftovers (egg-info)."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, out = tmp_path_factory.mktemp("source") / "repo", tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO_ROOT, source, ignore=SKIP)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, cwd=out)
    return next(out.glob("relax_pipeline-*.whl"))


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv with the wheel installed and the test environment's site-packages as a plain path entry."""
    root = tmp_path_factory.mktemp("fresh-venv")
    venv.create(root, with_pip=False)
    python = root / "bin" / "python"
    target = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                          text=True).strip())
    (target / "test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    return python


def test_wheel_carries_the_config_groups_and_examples(wheel: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert "relax_pipeline/conf/config.yaml" in names
    assert "relax_pipeline/examples/toy_digits/agent.py" in names
    assert "relax_pipeline/examples/toy_digits/data.jsonl" in names
    assert {f"relax_pipeline/view/static/{f}" for f in ("index.html", "viewer.js", "charts.js", "viewer.css",
                                                       "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css",
                                                       "vendor/uplot/LICENSE", "vendor/uplot/README.md")} <= names


def test_installed_wheel_runs_job_check_from_an_empty_directory(fresh_python: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([fresh_python, "-c", "import relax_pipeline; print(relax_pipeline.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout
    assert str(fresh_python.parent.parent) in where and str(REPO_ROOT) not in where
    done = subprocess.run([fresh_python, "-m", "relax_pipeline", "job=check", f"output_dir={tmp_path / 'out'}",
                           f"model.cache_dir={tmp_path / 'cache'}"], cwd=empty, env=env, capture_output=True,
                          text=True, timeout=300)
    log = (tmp_path / "out" / "run.log").read_text() if (tmp_path / "out" / "run.log").exists() else ""
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "check: OK" in log
    assert "relax_pipeline/examples/toy_digits" in log
