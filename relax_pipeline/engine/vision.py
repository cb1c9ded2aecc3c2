"""Vision input of a vision-language model: canonical images → processed features, once per image.

`Vision.load(model_path)` returns None for a text-only model folder and, for a Qwen2-VL-style folder
(`config.json` with a `vision_config` and an `image_token_id`, plus the image processor's
`preprocessor_config.json`), the model's image processor (the PIL backend: torchvision is not needed)
and its image placeholder token. `features(image)` decodes the image's URL (`data/media.py`), runs the
processor and returns `ImageFeatures` (pixel values, patch grid, placeholder count); results are cached
by the URL's digest, so a replayed history does not reprocess its images. A URL that cannot be read
raises `CanonicalError` naming the image's field, for a 400. An http(s) image is fetched on the
request path (5 s timeout, once per URL thanks to the cache); agents that care about latency send data URIs.

This module does not render templates or run the model; the chat template writes one placeholder token
per image and the engine expands it (`engine.base.expand_placeholders`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from relax_pipeline.canonical.form import CanonicalError, Image
from relax_pipeline.data.media import MediaError, load_image
from relax_pipeline.engine.base import ImageFeatures

CACHE_IMAGES = 256


class Vision:
    """A model's image processor and placeholder token, with a per-digest feature cache."""

    def __init__(self, image_processor: Any, image_token_id: int, cache_size: int = CACHE_IMAGES) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge_size = int(getattr(image_processor, "merge_size", 1) or 1)
        self._cache: OrderedDict[bytes, ImageFeatures] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str | Path) -> Vision | None:
        """The vision input of a model folder, or None for a text-only model."""
        folder = Path(model_path)
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if "vision_config" not in config:
            return None
        if not isinstance(config.get("image_token_id"), int):
            raise ValueError(f"{folder}/config.json has a vision_config but no image_token_id")
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
        return cls(processor, config["image_token_id"])

    def features(self, image: Image) -> ImageFeatures:
        """Processed features of one image (cached by digest)."""
        with self._lock:
            cached = self._cache.get(image.digest)
            if cached is not None:
                self._cache.move_to_end(image.digest)
                return cached
        features = self._process(image)
        with self._lock:
            self._cache[image.digest] = features
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return features

    def _process(self, image: Image) -> ImageFeatures:
        try:
            pil = load_image(image.url)
        except MediaError as error:
            raise CanonicalError(str(error), image.param) from None
        out = self.image_processor(images=[pil], return_tensors="pt")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size**2
        return ImageFeatures(out["pixel_values"], (grid[0], grid[1], grid[2]), tokens, image.digest)
