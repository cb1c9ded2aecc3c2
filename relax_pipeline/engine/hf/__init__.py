"""`engine=hf`: the embedded engine (`engine.py`), its padded KV batch (`batch.py`), its prefix KV cache
(`prefix_cache.py`) and its op-by-op decode step (`decode_step.py`). `HFEngine` is named here so the config's
`_target_` (`relax_pipeline.engine.hf.HFEngine`) stays the package's."""

from relax_pipeline.engine.hf.engine import HFEngine

__all__ = ["HFEngine"]
