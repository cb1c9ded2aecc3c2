"""How the config binds to the code, read from the source with `ast` (nothing is imported or built).

- Every configured class (named by a `_target_` in a record's defaults or in `conf/`, or made by a recipe,
  `recipes/*.py`) is found and defines the constructor it is built with (`bench/house.py` prints how many
  parameters each takes).
- Only `run.py` and `config.py` (and `__main__.py`, which hands the composed config to `run`) read the composed
  config: no other module imports OmegaConf or Hydra, or takes a parameter named `cfg` or typed `DictConfig`
  (`testing/`, the test doubles, may: `register_paced` adds their options to the config groups; so may
  `reference/`, which composes every preset for the config reference; `replay/job.py` reads a bundle's recorded
  config, never the composed one).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import relax_pipeline
from relax_pipeline.scheduling.settings import MODES

ROOT = Path(relax_pipeline.__file__).parent
READERS = {"run.py", "config.py", "__main__.py"}
"""The modules that may read the composed config."""
BUNDLE_READERS = {"replay/job.py"}
"""Modules that read a replay bundle's recorded `config.yaml` with OmegaConf (not the composed config)."""
DOC_PACKAGES = {"testing", "reference"}
"""Packages outside the run that compose configs themselves: the test doubles (`register_paced`) and the
reference pages' generator (every preset composed for `docs/reference/config.md`); no runtime module imports
either."""


def modules() -> dict[str, Path]:
    """Dotted module name → file, for every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def configured_classes() -> set[str]:
    """Dotted paths of the classes a `_target_` names (record defaults in the code and the yaml groups, and the
    runtime modes the switches choose)."""
    targets = set(re.findall(r"^_target_:\s*(\S+)", "\n".join(p.read_text() for p in (ROOT / "conf").rglob("*.yaml")),
                             re.M))
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_target_" and \
                    isinstance(node.value, ast.Constant) and node.value.value:
                targets.add(node.value.value)
    return targets | set(MODES.values()) | built_by_run()


def built_by_run() -> set[str]:
    """Classes the recipes construct by name (their imports resolved), `Name(...)` or `Name.of(...)`."""
    found: set[str] = set()
    for path in (ROOT / "recipes").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relax_pipeline")
                    for alias in node.names}
        calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
        called = {f.id for f in calls if isinstance(f, ast.Name)} | \
                 {f.value.id for f in calls if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)}
        found |= {imported[name] for name in called if name in imported and name[:1].isupper()}
    return found


def init_parameters(dotted: str) -> list[str] | None:
    """The `__init__` parameters (self excluded) of a class, following its bases inside the package; None for a
    dataclass without one (its fields are its record)."""
    module, _, name = dotted.rpartition(".")
    tree = ast.parse(modules()[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    a = item.args
                    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs][1:]
            return None
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return init_parameters(f"{node.module}.{name}")  # a re-export: follow it
    raise AssertionError(f"{dotted}: no such class")


def test_configured_classes_are_found() -> None:
    found = configured_classes()
    for dotted in ("relax_pipeline.train.torch_backend.TorchTrainer", "relax_pipeline.engine.sglang.SglangEngine",
                   "relax_pipeline.scheduling.sync.SyncRuntime", "relax_pipeline.gateway.server.GatewayServer"):
        assert dotted in found


@pytest.mark.parametrize("dotted", sorted(configured_classes()))
def test_a_configured_class_exists_where_its_target_says(dotted: str) -> None:
    """`init_parameters` finds the class (following re-exports) or fails naming it."""
    init_parameters(dotted)


def config_readers(path: Path) -> list[str]:
    """Where a module reads the composed config: OmegaConf/Hydra imports, `cfg` or `DictConfig` parameters."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in ("omegaconf", "hydra")]
        if isinstance(node, ast.arg) and (node.arg == "cfg" or "DictConfig" in ast.unparse(node.annotation or
                                                                                           ast.Constant(""))):
            found.append(f"line {node.lineno}: parameter {node.arg}")
    return found


def test_only_the_builder_and_the_schema_read_the_composed_config() -> None:
    readers = {str(p.relative_to(ROOT)): config_readers(p) for p in ROOT.rglob("*.py")
               if (p.name not in READERS or p.parent != ROOT) and p.relative_to(ROOT).parts[0] not in DOC_PACKAGES
               and str(p.relative_to(ROOT)) not in BUNDLE_READERS}
    offenders = {path: lines for path, lines in readers.items() if lines}
    assert not offenders, f"the composed config is read outside run.py/config.py: {offenders}"


def test_the_reader_check_catches_a_config_read(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from omegaconf import DictConfig\n\ndef f(cfg):\n    return cfg.rollout.batch_size\n")
    assert config_readers(module) == ["line 1: imports omegaconf", "line 3: parameter cfg"]
