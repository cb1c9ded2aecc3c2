"""Every job fails loudly on bad input, through the real command line (`python -m relax_pipeline job=... KEY=BAD`).

For each job (train, rollout, eval, check, replay, view) and each kind of input mistake (a missing path, a folder
that is not what the key needs, a bad value): the process exits non-zero, its stderr carries exactly one failure
line, `run failed: <sentence>`, as its last line, naming the key, the value and the fix, and no traceback; for the
jobs that write an output folder the same sentence is the last line of its `run.log`. `job=check` exits 2 (a
broken app, `certify/certificate.py`), every other job 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relax_pipeline.run import FOLDERLESS

CASES = [
    # (job, overrides; {tmp} is the test's folder), what the sentence must hold: the key and value, then the fix
    ("train", ["dataset.path=NO_SUCH.jsonl"], ["dataset.path='NO_SUCH.jsonl' does not exist", "JSONL file"]),
    ("train", ["dataset.path={tmp}/a_folder"], ["dataset.path='{tmp}/a_folder' is a folder", "JSONL file"]),
    ("train", ["model.path={tmp}/a_folder"], ["model.path='{tmp}/a_folder' is not a Hugging Face folder",
                                              "config.json"]),
    ("train", ["rollout.batch_size=0"], ["rollout.batch_size must be positive, got 0"]),
    ("rollout", ["agent.cwd=/NO_SUCH_DIR"], ["agent.cwd='/NO_SUCH_DIR' is not a directory", "agent.cwd=null"]),
    ("rollout", ["dataset.path={tmp}/not_json.jsonl"], ["dataset.path='{tmp}/not_json.jsonl' line 1 is not JSON",
                                                        "one JSON object per line"]),
    ("rollout", ["rollout.history=bogus"], ["rollout.history='bogus'", "choose one of ['tokens', 'render']"]),
    ("eval", [], ["job=eval evaluates the eval.datasets entries and there are none", "set eval.datasets="]),
    ("eval", ["eval.datasets=[{name:x,path:NO_SUCH.jsonl}]"],
     ["eval.datasets[0] name='x': dataset.path='NO_SUCH.jsonl' does not exist", "JSONL file"]),
    ("check", ["agent.cwd=/NO_SUCH_DIR"], ["agent.cwd='/NO_SUCH_DIR' is not a directory", "agent.cwd=null"]),
    ("check", ["check.sessions=-1"], ["check.sessions=-1 must be 0 (the config only) or more"]),
    ("replay", [], ["job=replay needs replay.bundle=FOLDER", "debug.replay_bundle=true"]),
    ("replay", ["replay.bundle=NO_SUCH_PATH"], ["replay.bundle='NO_SUCH_PATH' does not exist",
                                                "debug.replay_bundle=true"]),
    ("replay", ["replay.bundle={tmp}/a_folder"], ["replay.bundle='{tmp}/a_folder' holds no bundle.json",
                                                  "debug.replay_bundle=true"]),
    ("replay", ["replay.bundle={tmp}/not_json.jsonl"], ["replay.bundle='{tmp}/not_json.jsonl' is a file",
                                                        "debug.replay_bundle=true"]),
    ("view", ["view.dir=NO_SUCH_RUN"], ["view.dir='NO_SUCH_RUN' does not exist", "point it at a run's output folder"]),
    ("view", ["view.dir={tmp}/a_folder"], ["view.dir='{tmp}/a_folder' holds no run",
                                           "point it at a run's output folder"]),
    ("view", ["view.dir={tmp}/not_json.jsonl"], ["view.dir='{tmp}/not_json.jsonl' is a file",
                                                 "point it at a run's output folder"]),
    ("view", ["view.port=99999"], ["view.port=99999 is not a TCP port", "use 0"]),
]


def _id(case: tuple[str, list[str], list[str]]) -> str:
    job, overrides, _ = case
    return f"{job}:{' '.join(overrides) or 'nothing'}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_exits_with_one_sentence(case: tuple[str, list[str], list[str]], tmp_path: Path,
                                           tiny_path: Path) -> None:
    job, overrides, fragments = case
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "not_json.jsonl").write_text("this is not json\n")
    out = tmp_path / "out"
    args = [f"job={job}", f"model.cache_dir={tiny_path.parent}", f"output_dir={out}", "hydra.output_subdir=null",
            *(o.replace("{tmp}", str(tmp_path)) for o in overrides)]
    done = subprocess.run([sys.executable, "-m", "relax_pipeline", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == (2 if job == "check" else 1), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    failures = [line for line in lines if "run failed: " in line]
    assert len(failures) == 1 and failures[0] == lines[-1], done.stderr[-3000:]
    sentence = failures[0].split("run failed: ", 1)[1]
    for fragment in fragments:
        assert fragment.replace("{tmp}", str(tmp_path)) in sentence, sentence
    if job in FOLDERLESS:
        assert not (out / "run.log").exists(), f"job={job} writes no run folder"
    else:
        assert (out / "run.log").read_text().strip().splitlines()[-1].endswith(f"run failed: {sentence}")
