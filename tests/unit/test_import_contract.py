"""The import contract of docs/design.md §2: every package-to-package import is an edge listed in `ALLOWED`, and
no import closes a circle.

An AST walk over every module of the package (imports under `TYPE_CHECKING` and inside functions count: a hidden
circle is still a circle). Top-level modules (`run`, `config`, `loop`, `__main__`) are units of their own;
packages are units as a whole, and a module may import anything in its own unit. `ALLOWED` lists exactly the
edges the code uses: a new one fails here until it is added (so it is a decision made in review, not a side
effect), and one no longer used fails until it is removed. `relax_pipeline.testing` holds test doubles: it may
import anything, and nothing in the runtime imports it.

Adding an edge: check it points down docs/layout.md's floors (the allowed graph must stay free of circles,
which `test_the_allowed_edges_form_no_circle` checks), then add it here. A lower package that needs to call up
takes a `Protocol` declared by that lower package, or a callback, instead.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import relax_pipeline

ROOT = Path(relax_pipeline.__file__).parent
TESTING = "testing"
"""The test doubles: may import any unit, may be imported by none."""

ALLOWED: dict[str, set[str]] = {
    "__main__": {"config", "loop", "run"},
    "run": {"agent", "certify", "config", "data", "engine", "gateway", "infra", "loop", "models", "scheduling",
            "replay", "stages", "tracking", "train", "turn", "view"},
    "certify": {"canonical", "engine", "forest", "stages", "turn"},
    "view": {"models", "replay", "tracking"},
    "loop": {"engine", "forest", "replay", "scheduling", "stages", "tracking", "train"},
    "config": {"agent", "credit", "data", "engine", "gateway", "infra", "models", "protocol", "replay", "scheduling",
               "tracking", "train"},
    "replay": {"canonical", "credit", "forest", "stages", "train"},
    "scheduling": {"engine", "forest", "stages", "turn"},
    "stages": {"agent", "credit", "data", "forest", "tracking", "turn"},
    "gateway": {"canonical", "protocol", "tracking", "turn"},
    "protocol": {"canonical", "engine", "turn"},
    "turn": {"canonical", "engine", "forest"},
    "credit": {"forest", "train"},
    "train": {"engine", "forest", "infra", "models"},
    "agent": {"data", "forest", "infra"},
    "forest": {"canonical", "engine"},
    "engine": {"canonical", "data", "infra", "models"},
    "data": set(),
    "models": set(),
    "tracking": set(),
    "infra": set(),
    "canonical": set(),
}
"""Importing unit → the units it may import (besides itself), top to bottom as docs/layout.md lists them."""


def unit_of(module: str) -> str | None:
    """The unit of a `relax_pipeline...` module name: its first component below the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "relax_pipeline" and len(parts) > 1 else None


def module_name(path: Path, base: Path = ROOT.parent) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, base: Path = ROOT.parent) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path, base)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(parent + ([target] if target else []))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def edges(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) for every import across units of the package at `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        here = unit_of(module_name(path, root.parent))
        for line, target in imports_of(path, root.parent):
            there = unit_of(target)
            if here is not None and there is not None and there != here:
                out.append((str(path.relative_to(root.parent)), line, here, there))
    return out


def violations(found: Iterable[tuple[str, int, str, str]], allowed: Mapping[str, set[str]]) -> list[str]:
    """Every import `allowed` does not list (the runtime importing `testing` never is), one line each."""
    out = []
    for file, line, here, there in found:
        if here == TESTING:
            continue
        if there == TESTING:
            out.append(f"{file}:{line}: {here} imports {there} (test doubles; the runtime never imports them)")
        elif there not in allowed.get(here, set()):
            out.append(f"{file}:{line}: {here} imports {there}, a new edge: add \"{there}\" to ALLOWED[\"{here}\"] "
                       "if it points down docs/layout.md's floors, else invert it (a Protocol or a callback)")
    return out


@functools.cache
def real_edges() -> tuple[tuple[str, int, str, str], ...]:
    """`edges()` of the installed package, walked once per test session."""
    return tuple(edges())


def used_edges() -> set[tuple[str, str]]:
    """The (importing unit, imported unit) pairs the runtime uses."""
    return {(here, there) for _, _, here, there in real_edges() if here != TESTING}


def test_every_unit_is_listed() -> None:
    units = {unit_of(module_name(p)) for p in ROOT.rglob("*.py")} - {None, TESTING}
    missing = sorted(units - set(ALLOWED))
    assert not missing, f"units absent from ALLOWED (add them, with their edges, and to docs/layout.md): {missing}"
    gone = sorted(set(ALLOWED) - units)
    assert not gone, f"ALLOWED names units that no longer exist; remove them: {gone}"


def test_every_import_is_an_allowed_edge() -> None:
    found = violations(real_edges(), ALLOWED)
    assert not found, "imports along edges ALLOWED does not list (docs/design.md §2):\n" + "\n".join(found)


def test_every_allowed_edge_is_used() -> None:
    """ALLOWED is the list of edges the code uses, not a ceiling: an edge no import uses any more goes."""
    listed = {(here, there) for here, theres in ALLOWED.items() for there in theres}
    stale = sorted(listed - used_edges())
    assert not stale, f"edges in ALLOWED that no import uses any more; remove them: {stale}"


def test_the_allowed_edges_form_no_circle() -> None:
    """The package graph stays a set of floors: no unit reaches itself through the allowed edges."""
    graph = {unit: set(theres) for unit, theres in ALLOWED.items()}
    assert not (circle := _find_circle(graph)), "ALLOWED closes a circle: " + " → ".join(circle)


def test_no_circle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        name = module_name(path)
        graph[name] = {t for _, t in imports_of(path) if t.startswith("relax_pipeline.")}
    known = set(graph)

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    resolved = {m: {r for t in ts if (r := resolve(t)) and r != m and not m.startswith(r + ".")}
                for m, ts in graph.items()}
    assert not (circle := _find_circle(resolved)), "import circle: " + " → ".join(circle)


def _find_circle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def _write(root: Path, relative: str, text: str) -> None:
    path = root / "relax_pipeline" / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_catches_a_new_edge_in_a_made_up_package(tmp_path: Path) -> None:
    """On a small package written here: listed edges pass; a new one, a relative one, and the runtime importing
    `testing` are each reported with their file and line, and `testing` itself may import anything."""
    _write(tmp_path, "forest/__init__.py", "")
    _write(tmp_path, "forest/ok.py", "from relax_pipeline.engine.base import Engine\nfrom . import store\n")
    _write(tmp_path, "forest/bad.py", "import relax_pipeline.gateway.app\nif True:\n    from ..turn import leases\n")
    _write(tmp_path, "engine/base.py", "from relax_pipeline.testing import engines\n")
    _write(tmp_path, "testing/engines.py", "from relax_pipeline.run import run\n")
    found = violations(edges(tmp_path / "relax_pipeline"), {"forest": {"engine"}, "engine": set()})
    expected = ["relax_pipeline/engine/base.py:1: engine imports testing (test doubles",
                "relax_pipeline/forest/bad.py:1: forest imports gateway, a new edge: add \"gateway\" to ALLOWED",
                "relax_pipeline/forest/bad.py:3: forest imports turn, a new edge"]
    assert len(found) == len(expected), found
    assert all(line.startswith(start) for line, start in zip(found, expected, strict=True)), found


@pytest.mark.parametrize("edge", [("agent", "forest"), ("engine", "infra"), ("turn", "forest")])
def test_the_checker_catches_an_edge_missing_from_allowed(edge: tuple[str, str]) -> None:
    """On the real tree: with one used edge taken out of ALLOWED, its imports (and only they) are reported."""
    here, there = edge
    fewer = {unit: theres - {there} if unit == here else theres for unit, theres in ALLOWED.items()}
    found = set(violations(real_edges(), fewer)) - set(violations(real_edges(), ALLOWED))
    assert found and all(f": {here} imports {there}, a new edge" in line for line in found), found


def test_the_agent_executors_satisfy_the_protocol_their_consumers_declare() -> None:
    """`turn.leases.AgentRun` is declared by its consumer; no import ties the executors to it, so this does."""
    from relax_pipeline.agent.executors import EXECUTORS
    from relax_pipeline.agent.launcher import AgentSpec
    from relax_pipeline.turn.leases import ActiveClock, AgentRun

    for name, executor in EXECUTORS.items():
        agent = executor(AgentSpec(command="true", executor=name, server_url="http://127.0.0.1:9"))
        assert _missing(agent, AgentRun) == [], f"{executor.__name__} lacks members of turn.leases.AgentRun"
        assert _missing(agent.timer, ActiveClock) == [], f"{executor.__name__}.timer is no ActiveClock"


def _missing(obj: object, protocol: type) -> list[str]:
    """Members of `protocol` that `obj` lacks or offers with other parameters or as a non-coroutine."""
    out = []
    for member, wanted in vars(protocol).items():
        if member.startswith("_"):
            continue
        got = getattr(type(obj), member, None)
        if not hasattr(obj, member):
            out.append(member)
        elif inspect.isfunction(wanted) and (
                list(inspect.signature(wanted).parameters) != list(inspect.signature(got).parameters)
                or inspect.iscoroutinefunction(wanted) != inspect.iscoroutinefunction(got)):
            out.append(member)
    return out
