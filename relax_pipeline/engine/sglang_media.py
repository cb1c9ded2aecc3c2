"""Images on `engine=sglang`: the model's image processing for the turn service, and `image_data` for `/generate`.

SGLang processes images itself: `/generate` takes `image_data` (one item per image, in prompt order: a URL, a
`data:` URI or base64; SGLang 0.5.23 `GenerateReqInput.image_data`) with `input_ids` that hold one placeholder
token per image, unexpanded (SGLang decodes the ids, and its processor expands each placeholder to the image's
patch tokens, as `expand_placeholders` does). The turn service, though, hands the engine `ImageFeatures` (the
processed pixels the forest and the trainer keep, `engine/vision.py`), which carry the image's digest but not
its URL. `SglangVision` is the `ImageProcessor` the turn service uses on this engine: the model's own `Vision`,
which also remembers the URL of every image it processed for as long as features of that image are alive
(the forest holds them for the session's life), so `image_data(media)` can send the images again as SGLang
wants them. The processed features stay what `engine=hf` gives (the training input is the same).

What it does not do: fetch or decode images for SGLang (the server reads the URLs itself, so an http(s) URL must
be reachable from the servers), video or audio.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from relax_pipeline.canonical.form import Image
from relax_pipeline.engine.base import ImageFeatures
from relax_pipeline.engine.vision import Vision


class SglangVision:
    """`Vision` plus each processed image's URL, kept while features of that image are alive."""

    def __init__(self, vision: Vision) -> None:
        self.vision = vision
        self.image_token_id = vision.image_token_id
        self._urls: dict[bytes, str] = {}
        self._alive: Counter[bytes] = Counter()
        self._tracked: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str | Path) -> SglangVision | None:
        """The image processing of a model folder (`Vision.load`), or None for a text-only model."""
        vision = Vision.load(model_path)
        return cls(vision) if vision is not None else None

    def features(self, image: Image) -> ImageFeatures:
        """The processed image (`Vision.features`, cached by digest); its URL is remembered for `image_data`."""
        features = self.vision.features(image)
        with self._lock:
            self._urls[image.digest] = image.url
            if id(features) not in self._tracked:
                self._tracked.add(id(features))
                self._alive[image.digest] += 1
                weakref.finalize(features, self._release, id(features), image.digest)
        return features

    def image_data(self, media: Sequence[ImageFeatures]) -> list[str]:
        """The URLs of `media`, in order, for `/generate`'s `image_data`."""
        with self._lock:
            missing = [i for i, m in enumerate(media) if m.digest not in self._urls]
            if missing:
                raise ValueError(f"engine=sglang: image(s) {missing} of the prompt were not processed by this "
                                 "engine's `vision` (their URLs are unknown); the turn service must make the "
                                 "features with `engine.vision.features`")
            return [self._urls[m.digest] for m in media]

    def _release(self, ident: int, digest: bytes) -> None:
        with self._lock:
            self._tracked.discard(ident)
            self._alive[digest] -= 1
            if self._alive[digest] <= 0:
                del self._alive[digest]
                self._urls.pop(digest, None)


def expanded_length(prompt: Sequence[int], media: Sequence[ImageFeatures]) -> int:
    """Tokens of `prompt` once each image's placeholder is expanded to its patch tokens (what SGLang holds)."""
    return len(prompt) + sum(m.tokens - 1 for m in media)
