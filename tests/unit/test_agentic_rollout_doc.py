"""docs/agentic-rollout.md's map from the seed design's flags to our keys names only keys that exist.

Section 5's tables are read row by row: every backticked `group=option` must be an option of that group
(`relax_pipeline/conf/<group>/<option>.yaml`), and every backticked key (a name whose first segment is a field of
`config.Config`, `+` and `=value` stripped, cut at a `<name>` segment) must exist in the config composed with
Hydra's compose API under the options its row names (a key of `engine=sglang` is looked up with that option). A row
must name a key or say "no key" / "always on". Nothing is instantiated; no process or socket.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from relax_pipeline.config import CONF_DIR, Config, register

DOC = Path(__file__).resolve().parents[2] / "docs" / "agentic-rollout.md"
FIELDS = {f.name for f in dataclasses.fields(Config)}
CHOICE = re.compile(r"^([a-z_]+)=([\w]+)$")
KEY = re.compile(r"^\+?([a-z_]+(?:\.[\w<>]+)*)(?:=.*)?$")


def section_rows() -> list[tuple[str, list[str]]]:
    """(row text, its backticked names) of every table row in section 5."""
    text = DOC.read_text()
    section = text.split("\n## 5.", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| ---") and not line.startswith("| seed flag") \
                and not line.startswith("| what |"):
            mapped = line.split(" | ", 1)[1]
            rows.append((line, re.findall(r"`([^`]+)`", mapped)))
    return rows


@functools.cache
def composed(choices: tuple[str, ...]) -> DictConfig:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(choices))


def keys_named(names: list[str], choices: list[str]) -> list[str]:
    """The config keys among a row's names: `+agent.env.NAME=value` is looked up as `agent.env`."""
    keys = []
    for name in names:
        match = KEY.match(name)
        if name in choices or not match or match.group(1).split(".")[0] not in FIELDS:
            continue
        keys.append(match.group(1).rsplit(".", 1)[0] if name.startswith("+") else match.group(1))
    return keys


def has_key(cfg: DictConfig, key: str) -> bool:
    node = cfg
    for part in key.split("."):
        if part.startswith("<"):
            return True
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node[part]
    return True


def test_a_key_the_config_lacks_is_found_missing() -> None:
    cfg = composed(())
    assert has_key(cfg, "runtime.prelaunch") and has_key(cfg, "agent.services.<name>.port")
    assert not has_key(cfg, "runtime.agentic_prelaunch") and not has_key(cfg, "engine.sessions")
    assert keys_named(["+agent.env.NAME=value", "grpo", "engine.admission=program"], []) == ["agent.env",
                                                                                             "engine.admission"]


def test_section_5_is_there_and_maps_many_flags() -> None:
    rows = section_rows()
    assert len(rows) > 40, f"docs/agentic-rollout.md section 5 lost its tables ({len(rows)} rows)"


def test_every_row_maps_its_flag_to_keys_that_exist() -> None:
    problems = []
    for line, names in section_rows():
        choices = [n for n in names if CHOICE.match(n) and CHOICE.match(n).group(1) in groups()]
        for choice in choices:
            group, option = choice.split("=")
            if not (CONF_DIR / group / f"{option}.yaml").is_file():
                problems.append(f"{choice}: no such option (relax_pipeline/conf/{group}/{option}.yaml)")
        cfg = composed(tuple(choices))
        keys = keys_named(names, choices)
        for key in keys:
            if not has_key(cfg, key):
                problems.append(f"{key}: not in the config composed with {choices or 'the defaults'}")
        if not keys and not choices and "no key" not in line and "always on" not in line:
            problems.append(f"a row names no key and does not say 'no key': {line}")
    assert not problems, "docs/agentic-rollout.md section 5:\n" + "\n".join(problems)


def groups() -> set[str]:
    return {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
