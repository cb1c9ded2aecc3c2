"""The import contract of docs/design.md §2.1: every package-to-package import points down the one floor list,
`relax_pipeline/floors.py`, and no import closes a circle between modules.

An AST walk over every module of the package (imports under `TYPE_CHECKING` and inside functions count: a hidden
circle is still a circle). Top-level modules (`run`, `config`, `loop`, `__main__`, `floors`) are units of their
own; packages are units as a whole, and a module may import anything in its own unit. An import is allowed when
the imported unit sits on a floor below the importer's, or the pair is one of `floors.SIDEWAYS`;
`relax_pipeline.testing` holds test doubles: it may import anything, and nothing in the runtime imports it. A
unit the list does not name fails until it is placed on a floor.

A lower package that needs to call up takes a `Protocol` declared by that lower package, or a callback, instead.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

import relax_pipeline
from relax_pipeline import floors
from relax_pipeline.floors import TESTING

ROOT = Path(relax_pipeline.__file__).parent


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


def violations(found: Iterable[tuple[str, int, str, str]],
               allowed: Callable[[str, str], bool] = floors.allowed,
               floor_of: dict[str, int] | None = None) -> list[str]:
    """Every import that does not point down the floors (the runtime importing `testing` never does), one line
    each, naming the file, the line, both units and their floors."""
    floor_of = floors.floor_of() if floor_of is None else floor_of
    out = []
    for file, line, here, there in found:
        if here == TESTING:
            continue
        if there == TESTING:
            out.append(f"{file}:{line}: {here} imports {there} (test doubles; the runtime never imports them)")
        elif here not in floor_of or there not in floor_of:
            unknown = here if here not in floor_of else there
            out.append(f"{file}:{line}: {unknown} is on no floor: place it in relax_pipeline/floors.py's FLOORS")
        elif not allowed(here, there):
            way = "up" if floor_of[there] < floor_of[here] else "sideways"
            out.append(f"{file}:{line}: {here} (floor {floor_of[here]}) imports {there} (floor {floor_of[there]}), "
                       f"an edge pointing {way}: invert it (a Protocol or a callback) or move the code to its floor")
    return out


@functools.cache
def real_edges() -> tuple[tuple[str, int, str, str], ...]:
    """`edges()` of the installed package, walked once per test session."""
    return tuple(edges())


def test_every_unit_is_on_a_floor() -> None:
    units = {unit_of(module_name(p)) for p in ROOT.rglob("*.py")} - {None, TESTING}
    placed = set(floors.floor_of())
    missing = sorted(units - placed)
    assert not missing, f"units on no floor (place them in relax_pipeline/floors.py and docs/layout.md): {missing}"
    gone = sorted(placed - units)
    assert not gone, f"relax_pipeline/floors.py names units that no longer exist; remove them: {gone}"


def test_no_unit_is_on_two_floors() -> None:
    listed = [unit for units, _ in floors.FLOORS for unit in units]
    assert len(listed) == len(set(listed)), sorted({u for u in listed if listed.count(u) > 1})


def test_every_import_points_down_the_floors() -> None:
    found = violations(real_edges())
    assert not found, "imports that do not point down relax_pipeline/floors.py (docs/design.md §2.1):\n" + \
        "\n".join(found)


def test_every_sideways_pair_is_used_and_on_one_floor() -> None:
    used = {(here, there) for _, _, here, there in real_edges()}
    floor_of = floors.floor_of()
    for here, there in floors.SIDEWAYS:
        assert floor_of[here] == floor_of[there], f"SIDEWAYS pair {(here, there)} spans two floors"
        assert (here, there) in used, f"SIDEWAYS pair {(here, there)} is no longer used; remove it"


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


MADE_UP_FLOORS = {"gateway": 0, "forest": 1, "engine": 2}
"""A made-up floor list for the self-tests: gateway above forest above engine."""


def made_up_allowed(here: str, there: str) -> bool:
    return here == TESTING or MADE_UP_FLOORS[there] > MADE_UP_FLOORS[here]


def test_the_checker_catches_an_upward_edge_an_unknown_unit_and_testing(tmp_path: Path) -> None:
    """On a small package written here: downward edges pass; an upward one (absolute and relative), a unit on no
    floor, and the runtime importing `testing` are each reported with their file and line, and `testing` itself may
    import anything."""
    _write(tmp_path, "forest/__init__.py", "")
    _write(tmp_path, "forest/ok.py", "from relax_pipeline.engine.base import Engine\nfrom . import store\n")
    _write(tmp_path, "forest/bad.py", "import relax_pipeline.gateway.app\nif True:\n    from ..gateway import server\n")
    _write(tmp_path, "forest/odd.py", "from relax_pipeline.nowhere import thing\n")
    _write(tmp_path, "engine/base.py", "from relax_pipeline.testing import engines\n")
    _write(tmp_path, "testing/engines.py", "from relax_pipeline.gateway.app import app\n")
    found = violations(edges(tmp_path / "relax_pipeline"), made_up_allowed, MADE_UP_FLOORS)
    expected = ["relax_pipeline/engine/base.py:1: engine imports testing (test doubles",
                "relax_pipeline/forest/bad.py:1: forest (floor 1) imports gateway (floor 0), an edge pointing up",
                "relax_pipeline/forest/bad.py:3: forest (floor 1) imports gateway (floor 0), an edge pointing up",
                "relax_pipeline/forest/odd.py:1: nowhere is on no floor"]
    assert len(found) == len(expected), found
    assert all(line.startswith(start) for line, start in zip(found, expected, strict=True)), found


def test_a_same_floor_edge_needs_its_pair_listed() -> None:
    """`floors.allowed` refuses an edge within one floor unless SIDEWAYS lists it, and an upward edge always."""
    assert not floors.allowed("data", "models") and not floors.allowed("models", "data")
    assert floors.allowed("engine", "models") and not floors.allowed("models", "engine")
    assert not floors.allowed("engine", "no_such_unit") and floors.allowed(TESTING, "run")


@pytest.mark.parametrize("edge", [("forest", "agent"), ("engine", "infra"), ("turn", "forest")])
def test_the_checker_catches_a_used_edge_it_is_told_to_refuse(edge: tuple[str, str]) -> None:
    """On the real tree: with one used edge refused, its imports (and only they) are reported."""
    here, there = edge

    def refusing(a: str, b: str) -> bool:
        return (a, b) != edge and floors.allowed(a, b)

    found = set(violations(real_edges(), refusing)) - set(violations(real_edges()))
    assert found and all(f": {here} (floor" in line and f"imports {there} (floor" in line for line in found), found


def test_the_circle_finder_finds_a_circle_between_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_circle(graph) == ["a", "b", "c", "a"]
    assert _find_circle({"a": {"b"}, "b": set()}) == []


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
