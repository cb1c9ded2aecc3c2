"""One recipe per job: `train`, `rollout`, `eval`, `check`, `replay`, `view` (a module each, `run(job)`), and the
parts they build from the records (`parts.py`). `run.py` picks the job's recipe (`RECIPES`)."""
