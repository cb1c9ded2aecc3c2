"""`python -m relax_pipeline [overrides]`: compose the config with Hydra and call `run(cfg)`."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from relax_pipeline.config import register
from relax_pipeline.run import run

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except Exception:  # noqa: BLE001 - run() already logged why in one sentence
        sys.exit(1)


if __name__ == "__main__":
    main()
