"""Every option of every config group, and every `experiment=` preset, composes and becomes its records.

Nothing is built or run: `config.records` makes each node's record, so a bad default, a missing field or a yaml key
that its record does not know fails here, in the unit tier, instead of at a user's start. Options that need a value
no default can give (the scripted engine's script, where SGLang servers are) get one from `REQUIRED`.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, SCHEMAS, Config, records, register
from relax_pipeline.infra import ports

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
REQUIRED = {
    "engine=scripted": ["engine.script=/unused.jsonl"],
    "engine=sglang": ["engine.urls=[http://127.0.0.1:1]"],
}
"""Overrides an option cannot compose to records without (no default can name a user's file or server)."""


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def named_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """`${relax_free_port:NAME}` answers from a fixed table (the unit tier binds no socket to find a free one)."""
    monkeypatch.setattr(ports, "_NAMED", {})
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": 40000)


def made(*overrides: str) -> Config:
    register()
    extra = [o for choice in overrides for o in REQUIRED.get(choice, [])]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return records(compose("config", overrides=[*overrides, *extra]))


@pytest.mark.parametrize("choice", [f"{g}={o}" for g in GROUPS for o in options(g)])
def test_every_option_of_every_group_becomes_its_records(choice: str) -> None:
    config = made(choice)
    group, option = choice.split("=")
    node = getattr(config, group, None)
    if group in SCHEMAS:
        assert type(node) in SCHEMAS[group].values(), f"{choice}: {type(node).__name__} is not a {group} schema"
    if group != "experiment":
        assert node is not None and not isinstance(node, dict), f"{choice} did not become a record"
    for record in (config.model, config.credit, config.runtime, config.tracking, config.engine, config.trainer,
                   config.dataset):
        assert "." in record._target_, f"{choice}: {type(record).__name__}._target_ names no class"


@pytest.mark.parametrize("choice", ["engine.script", "agent.command"])
def test_a_required_key_left_unset_is_named_with_its_path(choice: str) -> None:
    register()
    overrides = ["engine=scripted"] if choice == "engine.script" else ["agent.command=???"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ValueError, match=choice.replace(".", r"\.")):
        records(cfg)
