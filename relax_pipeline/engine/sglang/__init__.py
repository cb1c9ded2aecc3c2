"""`engine=sglang`: the HTTP client of SGLang servers (`client.py`) and its parts: the `/generate` wire
(`wire.py`), launching servers and the router (`launch.py`), Ray placement (`placement.py`), affinity and KV
admission (`routing.py`), SGLang sessions (`sessions.py`), weight transfer (`weights.py`) and images
(`media.py`). `SglangEngine` is named here so the config's `_target_` (`relax_pipeline.engine.sglang.SglangEngine`)
stays the package's."""

from relax_pipeline.engine.sglang.client import SglangEngine

__all__ = ["SglangEngine"]
