"""One seed-mixing rule: `engine.base.derive_seed` is the package's only definition (the audit found two that
mixed differently), and it depends on its parts only."""

from __future__ import annotations

import ast
from pathlib import Path

import relax_pipeline
from relax_pipeline.engine.base import derive_seed

PACKAGE = Path(relax_pipeline.__file__).parent


def test_derive_seed_is_defined_once_in_the_package() -> None:
    where = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name == "derive_seed"]
    assert where == ["engine/base.py"]


def test_derive_seed_depends_on_its_parts_only() -> None:
    assert derive_seed(0, 1, 2, 3) == derive_seed(0, 1, 2, 3)
    seeds = {derive_seed(0, rollout, prompt, sample) for rollout in range(4) for prompt in range(4)
             for sample in range(4)}
    assert len(seeds) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 2) != derive_seed(12) != derive_seed(2, 1)
