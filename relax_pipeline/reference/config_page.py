"""`docs/reference/config.md`: every key of the composed config, generated from the typed records.

The keys are walked from `config.Config` (`records.sections`), and for the groups whose record depends on the
option (`config.SCHEMAS`: engine, trainer, dataset) from each kind's record. Defaults are the records' own; the
"default run" value is the one the composed default config gives where that differs; the presets column names the
`experiment=` presets whose composed config gives the key another value than the default run (each preset is
composed with Hydra's compose API and compared key by key, interpolations unresolved). Group options and presets
are described by the first sentence of their yaml file's leading comment.

What it does not do: check the values (each record does when it is made) or resolve interpolations (a
`${relax_free_port:NAME}` would pick a port).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from relax_pipeline import config
from relax_pipeline.reference.markdown import code, generated_note, prose, table, value
from relax_pipeline.reference.records import REQUIRED, Section, sections, source_of

EXPERIMENT = "experiment"


@dataclass(frozen=True)
class Composed:
    """One composed config, flattened to dotted keys (lists and empty dicts are leaves), and its group choices."""

    values: dict[str, Any]
    choices: dict[str, str]


def compose_flat(overrides: list[str]) -> Composed:
    """The config composed with `overrides`, interpolations left as written."""
    config.register()
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    choices = {k: v for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()  # type: ignore[union-attr]
               if v is not None and not k.startswith("hydra/")}
    tree = OmegaConf.to_container(cfg, resolve=False)
    tree.pop("hydra")  # type: ignore[union-attr]
    return Composed(dict(_flatten(tree, "")), choices)


def _flatten(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict) and tree:
        for key, item in tree.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (config.CONF_DIR / group).glob("*.yaml"))


def groups() -> list[str]:
    return sorted(p.name for p in config.CONF_DIR.iterdir() if p.is_dir() and p.name != EXPERIMENT)


def kind_of(group: str, option: str) -> str | None:
    """The `<kind>_schema` an option of a `config.SCHEMAS` group names in its defaults list."""
    defaults = OmegaConf.load(config.CONF_DIR / group / f"{option}.yaml").get("defaults") or []
    names = [d for d in defaults if isinstance(d, str) and d.endswith("_schema")]
    return names[0].removesuffix("_schema") if names else None


def about(path: Path) -> str:
    """The first sentence of a yaml file's leading comment (`# @package` lines skipped)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            lines.append(line.lstrip("#").strip())
    return first_sentence(" ".join(lines))


def first_sentence(text: str) -> str:
    """Up to the first full stop outside brackets that ends a sentence (followed by a space or the end)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if char == "." and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i + 1]
    return text


class ConfigPage:
    """Composes the default run and every preset once, then renders the page."""

    def __init__(self) -> None:
        self.default = compose_flat([])
        self.presets = {name: compose_flat([f"{EXPERIMENT}={name}"]) for name in options(EXPERIMENT)}

    def render(self) -> str:
        parts = [self._head(), self._groups(), self._presets(), "## Top-level keys\n", self._top()]
        for field in _node_fields():
            parts.append(self._node(field))
        return "\n".join(parts)

    def _head(self) -> str:
        return ("# Configuration keys\n\n" + generated_note("the typed records (`relax_pipeline.config.Config` and "
                                                           "`config.SCHEMAS`)") + "\n" + HOW_TO_READ)

    def _groups(self) -> str:
        rows = []
        for group in groups():
            for option in options(group):
                chosen = self.default.choices.get(group) == option
                kind = kind_of(group, option) if group in config.SCHEMAS else None
                record = config.SCHEMAS[group][kind].__name__ if kind else _record_name(group)
                rows.append([code(f"{group}={option}") + (" (default)" if chosen else ""),
                             code(record) if record else "", prose(about(config.CONF_DIR / group / f"{option}.yaml"))])
        return "## Groups and their options\n\n" + table(["option", "record", "what it is"], rows)

    def _presets(self) -> str:
        rows = [[code(f"{EXPERIMENT}={name}"), prose(about(config.CONF_DIR / EXPERIMENT / f"{name}.yaml"))]
                for name in self.presets]
        return ("## Presets\n\n`experiment=NAME` lays a preset over the default run "
                "(`relax_pipeline/conf/experiment/`); the tables below name, for each key, the presets that give it "
                "another value.\n\n"
                + table(["preset", "what it is"], rows))

    def _top(self) -> str:
        top = sections(config.Config, "")[0]
        keys = [k for k in top.keys if k.key not in config.SCHEMAS]
        return self._table(Section("", config.Config, tuple(keys)), None)

    def _node(self, field: str) -> str:
        out = [f"## `{field}`\n"]
        if field in config.SCHEMAS:
            shown: dict[tuple[str, type], str] = {}
            for kind, record in config.SCHEMAS[field].items():
                names = [o for o in options(field) if kind_of(field, o) == kind]
                out.append(f"### `{field}` as {', '.join(code(f'{field}={o}') for o in names) or 'its ' + kind}\n")
                for section in sections(record, field):
                    earlier = shown.get((section.prefix, section.record))
                    if earlier and section.prefix != field:
                        out.append(f"`{section.prefix}.*`: as for `{field}={earlier}` above "
                                   f"(record `{section.record.__name__}`).\n")
                        continue
                    shown.setdefault((section.prefix, section.record), names[0] if names else kind)
                    out.append(self._section(section, (field, kind), level=4))
            return "\n".join(out)
        record = _record_of(field)
        out += [self._section(s, None, level=3) for s in sections(record, field)]
        return "\n".join(out)

    def _section(self, section: Section, kind: tuple[str, str] | None, level: int) -> str:
        record = section.record
        top = section.prefix.count(".") == 0 and "[" not in section.prefix
        title = "" if top else f"{'#' * level} `{section.prefix}`\n\n"
        doc = prose(record.__doc__) if record.__doc__ and not record.__doc__.startswith(record.__name__ + "(") else ""
        where = f"Record `{record.__name__}`, declared in `{source_of(record)}`."
        return title + (f"{where} {doc}" if doc else where) + "\n\n" + self._table(section, kind)

    def _table(self, section: Section, kind: tuple[str, str] | None) -> str:
        rows = []
        for key in section.keys:
            default = "required" if key.default == REQUIRED else value(key.default)
            run = self._default_run(key.key, kind)
            if run is not None and run != key.default:
                default += f" (default run: {value(run)})"
            rows.append([code(key.key), code(key.type), default, self._changed_by(key.key, kind), prose(key.doc)])
        return table(["key", "type", "default", "presets that change it", "description"], rows)

    def _default_run(self, key: str, kind: tuple[str, str] | None) -> Any:
        if not self._kind_matches(self.default, kind) or "[]" in key:
            return None
        return _subtree(self.default.values, key)

    def _changed_by(self, key: str, kind: tuple[str, str] | None) -> str:
        names = [name for name, composed in self.presets.items() if self._kind_matches(composed, kind)
                 and "[]" not in key and _subtree(composed.values, key) != _subtree(self.default.values, key)]
        return ", ".join(code(n) for n in names)

    @staticmethod
    def _kind_matches(composed: Composed, kind: tuple[str, str] | None) -> bool:
        if kind is None:
            return True
        group, wanted = kind
        return kind_of(group, composed.choices[group]) == wanted


def _subtree(values: dict[str, Any], key: str) -> Any:
    """The value at `key` of a flattened config: a leaf, or the dict of the leaves under it; None when absent."""
    if key in values:
        return values[key]
    under = {k[len(key) + 1:]: v for k, v in values.items() if k.startswith(key + ".")}
    return under or None


def _node_fields() -> list[str]:
    """`Config`'s fields that are nodes (a record, or a group typed per option), in declaration order."""
    top = {k.key for k in sections(config.Config, "")[0].keys}
    nodes = [s.prefix for s in sections(config.Config, "") if s.prefix and "." not in s.prefix]
    order = [f for f in config.Config.__dataclass_fields__ if f in nodes or f in config.SCHEMAS]
    return [f for f in order if f not in top or f in config.SCHEMAS]


def _record_name(group: str) -> str:
    found = [s.record for s in sections(config.Config, "") if s.prefix == group]
    return found[0].__name__ if found else ""


def _record_of(field: str) -> type:
    return next(s.record for s in sections(config.Config, "") if s.prefix == field)


HOW_TO_READ = """\
Every key is set on the command line as `key=value` (`python -m relax_pipeline rollout.num_steps=4`); a group is
chosen as `group=option` (`engine=sglang`), and a preset with `experiment=NAME`. `python -m relax_pipeline --cfg job`
prints the composed config.

- **type**: the field's annotation in its record. A misspelt key or a value of the wrong type fails when the config
  is composed, naming the key.
- **default**: the record's default; "default run" is the value `python -m relax_pipeline` composes with no
  override (`relax_pipeline/conf/config.yaml` and the default options), where it differs. "required" keys have no
  default: the run refuses to start without them.
- **presets that change it**: the `experiment=` presets whose composed config gives the key another value than the
  default run.
- **description**: the docstring under the field in its record.
"""


def render() -> str:
    return ConfigPage().render()
