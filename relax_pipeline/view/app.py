"""The run viewer's web app: a JSON API over one run folder and the static page that draws it.

Routes (all GET): `/` the page (`static/index.html`; its JS and CSS under `/static/`, shipped in the package,
no CDN); `/api/run` the run's overview (folder, job, model, steps with dumps, where metrics come from, the
last log line, when anything last changed); `/api/metrics` every metric as (step, value) points;
`/api/steps/{step}/sessions?status=&offset=&limit=` one page of a step's sessions with per-status counts
(`view/dump_index.py`); `/api/steps/{step}/sessions/{session_id}` one session's tree and contexts with
tokens (`view/session.py`) and the weight version the step trained (for each token's version lag);
`/api/steps/{step}/sessions/{session_id}/trace` the session's trace as a timeline (`view/traces.py`; 404 when
no trace file holds it); `/api/bundle` a replay bundle's manifest, metrics and credit per group when the folder
is a bundle (`view/bundle.py`); `/api/check` the `job=check` certificate (`check/certificate.json`, written by
`relax_pipeline/certify/`) and its worst turn: the first template drift that forked a session, else the first
drift. `{step}` is a dump's `{rollout_id}`: a step number or `eval_<name>_<n>`.
Every request re-reads what changed on disk, so reloading the page shows a running run's new steps.

The app only reads the folder; errors are 404s naming what is missing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from relax_pipeline.tracking.metrics_file import METRICS_FILE
from relax_pipeline.view.dump_index import STATUSES, IndexCache
from relax_pipeline.view.folder import DumpFile, RunFolder
from relax_pipeline.view.session import session_view
from relax_pipeline.view.tokens import TokenText, tokenizer_folder
from relax_pipeline.view.traces import NO_TRACE, TraceIndex

STATIC = Path(__file__).parent / "static"
PAGE_LIMIT = 500


class Viewer:
    """The state behind the routes: the folder, its dump indexes and the token decoder."""

    def __init__(self, root: Path, tokenizer: str | None = None) -> None:
        self.folder = RunFolder(root)
        self.indexes = IndexCache()
        self.traces = TraceIndex(self.folder.root)
        self._tokenizer_given = tokenizer
        self._text: TokenText | None = None

    @property
    def text(self) -> TokenText:
        if self._text is None:
            self._text = TokenText(tokenizer_folder(self.folder.root, self.folder.config(), self._tokenizer_given))
        return self._text

    def dump(self, step: str) -> DumpFile:
        for dump in self.folder.dump_files():
            if dump.id == step:
                return dump
        raise HTTPException(404, f"step {step!r} has no dump file in {self.folder.root}")

    def overview(self) -> dict[str, Any]:
        folder, config = self.folder, self.folder.config()
        dumps = folder.dump_files()
        source, _ = folder.metrics()
        files = [folder.root / "run.log", folder.root / METRICS_FILE, *(d.path for d in dumps)]
        updated = max((p.stat().st_mtime for p in files if p.exists()), default=None)
        return {"folder": str(folder.root), "job": config.get("job"), "model": (config.get("model") or {}).get("name"),
                "dump_pattern": (config.get("debug") or {}).get("save_rollout_data"),
                "num_steps": (config.get("rollout") or {}).get("num_steps"),
                "steps": [{"id": d.id, "kind": d.kind, "bytes": d.path.stat().st_size} for d in dumps],
                "metrics_source": source, "last_log_line": folder.log.last_line, "updated": updated,
                "now": time.time(), "statuses": STATUSES,
                "bundle": None if folder.bundle is None else folder.bundle.brief(),
                "traces": self.traces.folder.is_dir()}

    def sessions(self, step: str, status: str | None, offset: int, limit: int) -> dict[str, Any]:
        if status and status not in STATUSES:
            raise HTTPException(404, f"status={status!r} is not a row status; choose one of {list(STATUSES)}")
        page = self.indexes.get(self.dump(step).path).page(status, offset, limit)
        self.text.preload()  # a session is likely opened next
        return {"step": step, **page}

    def check(self) -> dict[str, Any]:
        found = self.folder.certificate()
        if found is None:
            raise HTTPException(404, f"{self.folder.root} has no check/certificate.json: run job=check on it")
        stages = {s.get("name"): s for s in found.get("stages", [])}
        drifts = [t for t in (stages.get("template") or {}).get("evidence", {}).get("first_differences", [])
                  if t.get("first_difference")]
        worst = next((t for t in drifts if t.get("forked")), drifts[0] if drifts else None)
        return {"certificate": found, "worst": worst}

    def session(self, step: str, session_id: str) -> dict[str, Any]:
        index = self.indexes.get(self.dump(step).path)
        if session_id not in index.by_id:
            raise HTTPException(404, f"step {step!r} has no session {session_id!r}")
        view = session_view(step, index.read_rows(session_id), self.folder.forks(session_id), self.text)
        return {**view, "trained_version": self.folder.trained_version(step)}

    def trace(self, step: str, session_id: str) -> dict[str, Any]:
        found = self.traces.find(session_id, step)
        if found is None:
            raise HTTPException(404, f"{NO_TRACE}: no {self.traces.folder.name}/step_*.jsonl in {self.folder.root} "
                                     f"holds session {session_id!r}")
        return found

    def bundle(self) -> dict[str, Any]:
        if self.folder.bundle is None:
            raise HTTPException(404, f"{self.folder.root} is not a replay bundle (no bundle.json): open a "
                                     "<output>/replay/step_<n> folder")
        return self.folder.bundle.summary()


def create_app(root: Path, tokenizer: str | None = None) -> FastAPI:
    """The viewer app for the run folder `root` (`tokenizer`: a Hugging Face folder, see `view/tokens.py`)."""
    viewer = Viewer(root, tokenizer)
    app = FastAPI(title="relax_pipeline run viewer", docs_url=None, redoc_url=None)
    app.state.viewer = viewer
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/run")
    def run() -> dict[str, Any]:
        return viewer.overview()

    @app.get("/api/metrics")
    def metrics() -> dict[str, Any]:
        source, curves = viewer.folder.metrics()
        return {"source": source, "curves": curves}

    @app.get("/api/check")
    def check() -> dict[str, Any]:
        return viewer.check()

    @app.get("/api/steps/{step}/sessions")
    def sessions(step: str, status: str | None = None, offset: int = Query(0, ge=0),
                 limit: int = Query(50, ge=1, le=PAGE_LIMIT)) -> dict[str, Any]:
        return viewer.sessions(step, status, offset, limit)

    @app.get("/api/steps/{step}/sessions/{session_id}")
    def session(step: str, session_id: str) -> dict[str, Any]:
        return viewer.session(step, session_id)

    @app.get("/api/steps/{step}/sessions/{session_id}/trace")
    def trace(step: str, session_id: str) -> dict[str, Any]:
        return viewer.trace(step, session_id)

    @app.get("/api/bundle")
    def bundle() -> dict[str, Any]:
        return viewer.bundle()

    return app
