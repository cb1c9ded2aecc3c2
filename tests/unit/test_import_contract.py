"""The import contract of docs/design.md §2: every import points down the layers, and none closes a circle.

An AST walk over every module of the package (imports under `TYPE_CHECKING` and inside functions count:
a hidden circle is still a circle). A module may import its own package, and any package on a lower
floor; peers on one floor do not import each other. `relax_pipeline.testing` holds test doubles: it may
import anything, and nothing in the runtime imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relax_pipeline

ROOT = Path(relax_pipeline.__file__).parent
FLOORS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("run",),
    ("view",),
    ("loop",),
    ("config",),
    ("scheduling",),
    ("stages",),
    ("gateway",),
    ("protocol",),
    ("turn",),
    ("credit",),
    ("train",),
    ("forest",),
    ("engine",),
    ("agent",),
    ("data", "models", "tracking"),
    ("canonical",),
)
"""Top to bottom. Top-level modules are units of their own; packages are units as a whole."""


def unit_of(module: str) -> str | None:
    """The floor unit of a `relax_pipeline...` module name: its first component below the package."""
    parts = module.split(".")
    return parts[1] if parts[0] == "relax_pipeline" and len(parts) > 1 else None


def floor_of(unit: str) -> int:
    for floor, units in enumerate(FLOORS):
        if unit in units:
            return floor
    raise AssertionError(f"relax_pipeline.{unit} is on no floor of FLOORS; add it to docs/layout.md and this test")


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
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def edges() -> list[tuple[str, int, str, str]]:
    """(file, line, importing unit, imported unit) across units of the package."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        here = unit_of(module_name(path))
        for line, target in imports_of(path):
            there = unit_of(target)
            if here is not None and there is not None and there != here:
                out.append((str(path.relative_to(ROOT.parent)), line, here, there))
    return out


def test_every_unit_is_on_a_floor() -> None:
    units = {unit_of(module_name(p)) for p in ROOT.rglob("*.py")} - {None, "testing"}
    for unit in units:
        floor_of(unit)


def test_imports_point_down() -> None:
    upward = [f"{file}:{line}: {here} imports {there}" for file, line, here, there in edges()
              if here != "testing" and (there == "testing" or floor_of(there) <= floor_of(here))]
    assert not upward, "imports that point up or sideways (docs/design.md §2):\n" + "\n".join(upward)


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


def test_the_contract_test_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk itself works: a made-up forest module importing the gateway is reported."""
    bad = tmp_path / "relax_pipeline" / "forest" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from relax_pipeline.gateway.app import create_app\nif True:\n    from ..turn import leases\n")
    found = imports_of(bad, tmp_path)
    assert found == [(1, "relax_pipeline.gateway.app.create_app"), (3, "relax_pipeline.turn.leases")]
    assert all(floor_of(unit_of(target)) < floor_of("forest") for _, target in found)
