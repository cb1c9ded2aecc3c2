"""`config.validate` refuses a LoRA training run on an engine that cannot load adapters (engine=sglang), naming the
key and the fix, before anything starts; the same run on engine=hf, or full weights on engine=sglang, passes."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, records, register, validate


def checked(*overrides: str) -> None:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        validate(records(compose("config", overrides=list(overrides))))


def test_lora_with_sglang_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"trainer\.lora\.rank=8 with engine=sglang.*use engine=hf"):
        checked("engine=sglang", "engine.urls=[http://127.0.0.1:9]", "trainer.lora.rank=8")


def test_lora_with_the_embedded_engine_and_full_weights_with_sglang_pass() -> None:
    checked("trainer.lora.rank=8")
    checked("engine=sglang", "engine.urls=[http://127.0.0.1:9]")
