"""`job=view`: serve the run viewer (`relax_pipeline/view/`) on `view.dir` (else `output_dir`) until interrupted.

The recipe checks the folder first (`ViewSettings.folder`: it exists and holds a run or a replay bundle), then
serves it; it builds nothing else and writes nothing into the folder (no run.log, no config.yaml).
"""

from __future__ import annotations

from relax_pipeline.recipes.parts import Job
from relax_pipeline.view.server import serve_view


def run(job: Job) -> dict[str, float]:
    """Serve until interrupted; returns no metrics."""
    v = job.config.view
    return serve_view(v.folder(job.config.output_dir), v.host, v.port, v.tokenizer)
