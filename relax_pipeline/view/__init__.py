"""The run viewer: a small local web app over a run's output folder (curves, version lag, sessions per step, one
session's forest, tokens and trace timeline), started with `python -m relax_pipeline.view DIR` or
`job=view view.dir=DIR`; DIR may also be one replay bundle (`<output>/replay/step_<n>`).

Layer: just below `run` (only `run` and this package's `__main__` import it); it reads files that the
tracking floor, the dump, the tracing and the replay recorder write and never writes into the run folder.
Modules: `folder.py` (what the folder holds), `bundle.py` (a replay bundle folder), `dump_index.py` (sessions
of a dump file, paged), `session.py` (tree + tokens of one session), `traces.py` (a session's OTLP trace as a
timeline), `tokens.py` (token text), `app.py` (FastAPI routes), `server.py` (serving), `static/` (the page:
HTML, JS, CSS; no build step, no CDN; charts on uPlot 1.6.32, MIT, vendored in `static/vendor/uplot/` with
its licence).
"""
