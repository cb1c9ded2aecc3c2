"""`docs/reference/metrics.md`: the metric names a run can log, found in the code by an AST scan.

Every string literal and f-string in the package (its test doubles and this package left out) that starts with a
metric namespace (`NAMESPACES`) and is not a file name is a metric name, or a prefix of names built at run time.
An f-string's replacement fields are expanded where the scan can know their values: the field's names are bound by
an enclosing `for` loop or comprehension over something the module defines (a tuple, a dict's keys or items, a
`range`), which is evaluated in the module's namespace; a field it cannot know stays a placeholder, `<expr>`, its
source text. Each name lists the modules that write or read it.

What it does not do: say when a metric is logged or what it means beyond its namespace (docs/design.md §3.4), or
find names assembled without a literal of their namespace (a user's `credit.metrics_path` names, numeric export
metadata `<field>/mean`, `passrate`).
"""

from __future__ import annotations

import ast
import importlib
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_pipeline.reference.markdown import code, generated_note, prose, table

PACKAGE = Path(__file__).resolve().parents[1]
SKIPPED = ("testing", "reference")
"""Parts of the package the scan leaves out: test doubles, and this package (its own literals)."""
NAMESPACES = {
    "rollout": "the train rollout of each step: rewards, outcomes, groups, turns, tokens",
    "eval": "each eval dataset, `eval/<name>/...` with the rollout's names",
    "train": "the training step: loss terms, gradient norm, samples, weight version and lag",
    "perf": "time and throughput of each phase of a step",
    "engine": "the generation engine: prefill/decode work, KV admission, SGLang sessions",
    "agentic_kv": "`engine.admission=program`: sessions admitted by predicted KV use",
    "check": "`job=check`'s findings",
    "replay": "`job=replay`'s verdicts",
}
"""The metric namespaces, the first segment of every name, and what each covers."""
NAME = re.compile(rf"^({'|'.join(NAMESPACES)})/[A-Za-z0-9_./<>+\[\]-]*$")
FILE = re.compile(r"\.(json|jsonl|md|py|csv|png|yaml|log|safetensors)$")
MOST = 64
"""A loop over more values than this is not expanded (the field stays a placeholder)."""


def scan() -> tuple[dict[str, set[str]], set[str]]:
    """Metric name (or prefix) → the modules (paths from the package) that hold it; and the names an f-string's
    loop was expanded to."""
    found: dict[str, set[str]] = {}
    expanded: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in SKIPPED:
            continue
        tree = ast.parse(path.read_text())
        for name, from_loop in _names(tree, _module(path)):
            if NAME.match(name) and not FILE.search(name) and name.rstrip("/") not in NAMESPACES:
                found.setdefault(name, set()).add(relative.as_posix())
                if from_loop:
                    expanded.add(name)
    return found, expanded


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _names(tree: ast.Module, module: str) -> Iterator[tuple[str, bool]]:
    """Every string of the module, and whether it is an f-string expanded over its loop."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not isinstance(
                parents.get(node), ast.JoinedStr):
            yield node.value, False
        elif isinstance(node, ast.JoinedStr):
            yield from _expand(node, parents, module)


def _expand(node: ast.JoinedStr, parents: dict[ast.AST, ast.AST], module: str) -> Iterator[tuple[str, bool]]:
    """The f-string's values where its loop can be evaluated, else the f-string with placeholders."""
    prefix = "".join(str(v.value) for v in itertools.takewhile(lambda v: isinstance(v, ast.Constant), node.values))
    if not NAME.match(prefix + "x"):
        return
    names = []
    for bindings in _loop_values(node, parents, module):
        try:
            names.append("".join(str(v.value) if isinstance(v, ast.Constant) else
                                 str(eval(ast.unparse(v.value), bindings)) for v in node.values))  # noqa: S307
        except Exception:  # noqa: BLE001 - a field this binding cannot give: the placeholder form
            names = []
            break
    if names:
        yield from ((name, True) for name in names)
        return
    yield "".join(str(v.value) if isinstance(v, ast.Constant) else f"<{ast.unparse(v.value)}>"
                  for v in node.values), False


def _loop_values(node: ast.AST, parents: dict[ast.AST, ast.AST], module: str) -> Iterator[dict[str, Any]]:
    """Namespaces binding the innermost loop variables around `node` to each value of the loop (none: stop)."""
    loop = _enclosing_loop(node, parents)
    if loop is None:
        return
    target, iterable = loop
    try:
        namespace = vars(importlib.import_module(module))
        values = list(eval(ast.unparse(iterable), dict(namespace)))  # noqa: S307
    except Exception:  # noqa: BLE001 - a loop over run-time values
        return
    if len(values) > MOST:
        return
    for item in values:
        bound = dict(namespace)
        exec(f"{ast.unparse(target)} = __item", {**bound, "__item": item}, bound)  # noqa: S102
        yield bound


def _enclosing_loop(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> tuple[ast.expr, ast.expr] | None:
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    here = parents.get(node)
    while here is not None and not isinstance(here, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
        loops = here.generators if isinstance(here, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) \
            else [here] if isinstance(here, ast.For) else []
        for loop in loops:
            if used & {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}:
                return loop.target, loop.iter
        here = parents.get(here)
    return None


def merged(found: dict[str, set[str]], expanded: set[str]) -> dict[str, set[str]]:
    """A placeholder name that names expanded from a loop elsewhere match (`rollout/outcome/<outcome>` where
    `rollout/outcome/completed`, ... were expanded) folds into those names."""
    out = {name: set(modules) for name, modules in found.items()}
    for name, modules in found.items():
        if "<" not in name:
            continue
        pattern = re.compile("^" + "[^/]+".join(re.escape(p) for p in re.split(r"<[^>]*>", name)) + "$")
        matches = [n for n in expanded if pattern.match(n)]
        for match in matches:
            out[match] |= modules
        if matches:
            del out[name]
    return out


def render() -> str:
    found = merged(*scan())
    parts = ["# Metrics\n", generated_note("an AST scan of the package's metric names "
                                           "(`relax_pipeline/reference/metrics_page.py`)"), prose(METHOD) + "\n"]
    for namespace, about in NAMESPACES.items():
        names = sorted(n for n in found if n.split("/", 1)[0] == namespace)
        parts.append(f"## `{namespace}/`\n\n{prose(about[:1].upper() + about[1:])}.\n")
        parts.append(table(["name", "in"], [[code(n), ", ".join(code(m) for m in sorted(found[n]))] for n in names]))
    return "\n".join(parts)


METHOD = (
    "Every metric a run logs goes to `metrics.jsonl` in its output folder, to `run.log` and to the tracker "
    "(`tracking=wandb`). This list is found in the code: every string literal and f-string of the package that "
    "starts with a metric namespace and is not a file name. An f-string whose fields are bound by a loop over "
    "values the module defines (a tuple of outcomes, a dict of names, a range) is expanded to each name; a field "
    "known only at run time stays a placeholder, `<expr>`, its source text (`rollout/<name>`: a numeric "
    "reward-object field `name`, summarized as `/mean`, `/median`, `/max` and `/min`; `train/<k>`: each value of "
    "the training step's metrics, `loss`, `pg_loss`, `entropy`, ...). A name ending in `/` is a prefix under which "
    "names are built at run time. What each metric means: the design, §3.4. Not found by the scan: the names of a "
    "user's `credit.metrics_path` function (`rollout/user/<name>`), numeric top-level export metadata "
    "(`<field>/mean`, `/median`, `/max`, `/min`) and `passrate` (with `credit.log_passrate`).")

