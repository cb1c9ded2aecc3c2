"""Every engine provides every member of the `Engine` protocol, so callers never probe one with `getattr`.

The members are read from the protocol itself (annotations, properties and methods); an engine class has
a member when the class defines it or its `__init__` (or an ancestor's) assigns it. No engine is built.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from relax_pipeline.engine.base import Engine
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.testing.engines import (
    AbortingEngine,
    FailingEngine,
    PacedEngine,
    RecordingHFEngine,
    ScriptedEngine,
    StopStringEngine,
)
from relax_pipeline.testing.faults import FaultyScriptEngine
from relax_pipeline.testing.script_engine import ScriptEngine

ENGINES = [HFEngine, SglangEngine, ScriptEngine, FaultyScriptEngine, ScriptedEngine, AbortingEngine,
           StopStringEngine, FailingEngine, RecordingHFEngine, PacedEngine]


def protocol_members() -> set[str]:
    defined = {name for name in vars(Engine) if not name.startswith("_")}
    return defined | set(Engine.__annotations__)


def assigned_in_init(cls: type) -> set[str]:
    """`self.<name>` targets assigned in the `__init__` of `cls` and of its ancestors."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def test_the_protocol_lists_what_callers_use() -> None:
    assert {"tokenizer", "vision", "step_metrics", "max_batch_size", "weight_version", "max_context_len",
            "generate", "abort", "update_weights", "start", "close"} <= protocol_members()


@pytest.mark.parametrize("engine", ENGINES, ids=lambda cls: cls.__name__)
def test_every_engine_has_every_member(engine: type) -> None:
    missing = protocol_members() - set(dir(engine)) - assigned_in_init(engine)
    assert not missing, f"{engine.__name__} lacks Engine members {sorted(missing)}: define them (None if it has none)"
