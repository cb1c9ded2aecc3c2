"""The run viewer: a small local web app over a run's output folder (curves, sessions per step, one session's
forest and tokens), started with `python -m relax_pipeline.view DIR` or `job=view view.dir=DIR`.

Layer: just below `run` (only `run` and this package's `__main__` import it); it reads files that the
tracking floor and the dump write and never writes into the run folder. Modules: `folder.py` (what the
folder holds), `dump_index.py` (sessions of a dump file, paged), `session.py` (tree + tokens of one
session), `tokens.py` (token text), `app.py` (FastAPI routes), `server.py` (serving), `static/` (the
page: HTML, JS, CSS; no build step, no CDN; curves are inline SVG drawn by `static/viewer.js`).
"""
