"""`docs/reference/cli.md`: the command line, its jobs and the package's other commands, generated from the code.

The jobs are `config.JOBS`; what each does is the docstring of its recipe (`relax_pipeline/recipes/<job>.py`), or,
where there is none, its entry in `run.py`'s "Jobs:" paragraph. The keys each job reads on its own are the records
whose docstring opens with `` `job=<job>` ``. The exit statuses are `__main__.py`'s docstring, and the other
commands are every `__main__.py` of the package with its docstring. Docstrings are read with `ast` (nothing is
imported to read them).

What it does not do: list the config keys (`config_page.py`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from relax_pipeline import config
from relax_pipeline.reference.config_page import first_sentence
from relax_pipeline.reference.markdown import code, generated_note, prose, table
from relax_pipeline.reference.records import sections

PACKAGE = Path(__file__).resolve().parents[1]


def docstring(path: Path) -> str:
    """A module's docstring, read without importing it."""
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def job_about(job: str) -> str:
    """What `job=<job>` does: its recipe's docstring, else its entry in run.py's "Jobs:" paragraph."""
    recipe = PACKAGE / "recipes" / f"{job}.py"
    if recipe.is_file() and docstring(recipe):
        return docstring(recipe)
    found = _run_paragraph().get(job)
    if found is None:
        raise ValueError(f"job={job} (config.JOBS) is described nowhere: give relax_pipeline/recipes/{job}.py a "
                         "docstring, or an entry in run.py's 'Jobs:' paragraph")
    return found


def _run_paragraph() -> dict[str, str]:
    """run.py's "Jobs: `train` (what it does), `rollout` (...)" paragraph as job → what it does."""
    text = " ".join(docstring(PACKAGE / "run.py").split())
    start = text.find("Jobs:")
    found: dict[str, str] = {}
    while start >= 0:
        name_at = text.find("`", start)
        end_name = text.find("`", name_at + 1)
        if name_at < 0 or end_name < 0 or text[end_name + 1:end_name + 3] != " (":
            break
        depth, i = 0, end_name + 2
        for i in range(end_name + 2, len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
        found[text[name_at + 1:end_name]] = text[end_name + 3:i]
        start = i + 1
    return found


def job_records(job: str) -> list[str]:
    """The config nodes whose record's docstring names `` `job=<job>` `` in its first sentence (the keys that job
    reads alone)."""
    nodes = [s for s in sections(config.Config, "") if s.prefix and "." not in s.prefix]
    return [s.prefix for s in nodes if f"`job={job}`" in first_sentence(" ".join((s.record.__doc__ or "").split()))]


def commands() -> list[tuple[str, str]]:
    """Every `python -m` command of the package: (module, its docstring), the package's own first."""
    mains = sorted(PACKAGE.rglob("__main__.py"), key=lambda p: (len(p.parts), p.as_posix()))
    out = []
    for path in mains:
        module = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
        out.append((module, docstring(path)))
    return out


def summary(text: str) -> str:
    """A job's first line without its leading `` `job=...`: `` (the table names the job already)."""
    head = " ".join(text.partition("\n\n")[0].split())
    return head.split(": ", 1)[1] if head.startswith("`job=") and ": " in head else head


def render() -> str:
    rows, details = [], []
    for job in config.JOBS:
        text = job_about(job)
        keys = ", ".join(f"[{code(node + '.*')}](config.md#{node})" for node in job_records(job))
        rows.append([code(f"job={job}"), prose(summary(text)), keys])
        rest = text.partition("\n\n")[2]
        if rest:
            details.append(f"### `job={job}`\n\n" + "\n\n".join(prose(p) for p in rest.split("\n\n")) + "\n")
    parts = ["# Command line\n", generated_note("`config.JOBS`, the recipes' docstrings and the package's "
                                               "`__main__.py` modules"), INTRO,
             "## Jobs\n", "`job=NAME` picks what a run does (default `train`).\n",
             table(["job", "what it does", "keys it reads alone"], rows), *details,
             "## Commands\n", "Every `python -m` entry point of the package, with its own docstring.\n"]
    for module, text in commands():
        parts.append(f"### `python -m {module}`\n\n" + "\n\n".join(prose(p) for p in text.split("\n\n")) + "\n")
    return "\n".join(parts)


INTRO = """\
`python -m relax_pipeline [overrides]` composes one run from `relax_pipeline/conf/` with Hydra and runs its job.
Overrides are Hydra's: `key=value` sets a key ([every key](config.md)), `group=option` picks an option of a group
(`engine=sglang`), `experiment=NAME` lays a preset over the default run, `+key=value` adds a key to a dict
(`+agent.env.NAME=value`). Hydra's own flags work too: `--cfg job` prints the composed config and exits,
`--help` lists the groups, `-m`/`--multirun` sweeps comma-separated values.
"""
