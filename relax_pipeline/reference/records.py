"""The config's typed records as data: every key with its type, default, owning record and field docstring.

`keys(record, prefix)` walks a dataclass and the dataclasses its fields hold (a field typed by a record, a
`list[Record]` as `key[]`, a `dict[str, Record]` as `key.<name>`), so it follows whatever `Config` holds. Field
docstrings are the string literal under each field (PEP 257's attribute docstrings), read from the record's source
with `ast`; a subclass's inherited fields keep the docstring of the class that declares them.

What it does not do: compose the config or read yaml (`config_page.py` does, for defaults and presets).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REQUIRED = "???"
"""The default of a key that has none (OmegaConf's MISSING is this string): the run refuses to start without it."""


@dataclass(frozen=True)
class Key:
    """One config key of a record: what the reference's config page prints for it."""

    key: str
    type: str
    default: Any
    doc: str
    record: type


@dataclass(frozen=True)
class Section:
    """One record at one place in the config (`trainer.optim`, `eval.datasets[]`): its key prefix and its keys
    that are not records themselves."""

    prefix: str
    record: type
    keys: tuple[Key, ...]


def sections(record: type, prefix: str) -> list[Section]:
    """`record` at `prefix` and every record its fields hold, depth first, each as a `Section`."""
    hints = _hints(record)
    own: list[Key] = []
    nested: list[Section] = []
    for field in dataclasses.fields(record):
        key = f"{prefix}.{field.name}" if prefix else field.name
        inner, shape = nested_record(hints.get(field.name), field)
        if inner is not None:
            nested += sections(inner, key + shape)
            if shape == "":
                continue
        own.append(Key(key, type_name(field), default_of(field), field_docs(record).get(field.name, ""), record))
    return [Section(prefix, record, tuple(own)), *nested]


def nested_record(hint: Any, field: dataclasses.Field[Any]) -> tuple[type | None, str]:
    """The record a field holds and how: `""` (the field is one), `"[]"` (a list of them), `".<name>"` (a dict of
    them); (None, "") for a plain value."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, ""
    if hint is None and field.default_factory is not dataclasses.MISSING:
        made = field.default_factory()
        if dataclasses.is_dataclass(made):
            return type(made), ""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1], ".<name>"
    return None, ""


def _hints(record: type) -> dict[str, Any]:
    """The record's resolved field types; a field whose annotation does not resolve is left out."""
    try:
        return typing.get_type_hints(record)
    except Exception:  # noqa: BLE001 - an annotation naming something only TYPE_CHECKING imports
        module = vars(sys.modules[record.__module__])
        hints = {}
        for field in dataclasses.fields(record):
            try:
                hints[field.name] = eval(field.type, module) if isinstance(field.type, str) else field.type  # noqa: S307
            except Exception:  # noqa: BLE001
                continue
        return hints


def type_name(field: dataclasses.Field[Any]) -> str:
    """The field's annotation as written in its source (`int | None`, `dict[str, Any]`)."""
    if isinstance(field.type, str):
        return field.type
    return getattr(field.type, "__name__", None) or str(field.type).replace("typing.", "")


def default_of(field: dataclasses.Field[Any]) -> Any:
    """The field's default value (a factory called once); `REQUIRED` for a key without one."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        made = field.default_factory()
        return dataclasses.asdict(made) if dataclasses.is_dataclass(made) else made
    return REQUIRED


def field_docs(record: type) -> dict[str, str]:
    """Field name → the docstring under it, over the record's own class and the classes it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(record.__mro__):
        if klass is not object and dataclasses.is_dataclass(klass):
            docs.update(_class_docs(klass.__module__, klass.__qualname__))
    return docs


@functools.cache
def _class_docs(module: str, qualname: str) -> dict[str, str]:
    tree = _module_tree(module)
    node: ast.AST | None = tree
    for name in qualname.split("."):
        node = next((n for n in getattr(node, "body", []) if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return {}
    docs, body = {}, node.body  # type: ignore[attr-defined]
    for statement, after in zip(body, body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[statement.target.id] = after.value.value
    return docs


@functools.cache
def _module_tree(module: str) -> ast.Module:
    return ast.parse(Path(inspect.getfile(sys.modules[module])).read_text())


def source_of(record: type) -> str:
    """Where the record is declared, as a path from the repository root (`relax_pipeline/train/settings.py`)."""
    path = Path(inspect.getfile(record)).resolve()
    package = Path(__file__).resolve().parents[1]
    return path.relative_to(package.parent).as_posix()
