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

SGLang 0.5.23 reads such a prompt by decoding the ids to text and tokenizing the text again (its multimodal
processor works on text), so a prompt whose text does not tokenize back to the same ids is served as a slightly
different prompt than the forest records. `served` compares `meta_info.prompt_tokens` with the expanded length and
warns once and counts when they differ (the step metric `engine/image_token_mismatches`, `take_metrics`), or fails
the turn with `engine.image_mismatch=refuse`; the fake server does not re-tokenize.

What it does not do: fetch or decode images for SGLang (the server reads the URLs itself, so an http(s) URL must
be reachable from the servers), video or audio.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_pipeline.canonical.form import Image
from relax_pipeline.engine.base import ImageFeatures
from relax_pipeline.engine.vision import Vision

log = logging.getLogger(__name__)


class SglangVision:
    """`Vision` plus each processed image's URL, kept while features of that image are alive."""

    def __init__(self, vision: Vision) -> None:
        self.vision = vision
        self.image_token_id = vision.image_token_id
        self._urls: dict[bytes, str] = {}
        self._alive: Counter[bytes] = Counter()
        self._tracked: set[int] = set()
        self._lock = threading.Lock()
        self.mismatches = 0
        """Image prompts SGLang served with another token count than ours since the last `take_metrics`."""
        self.total_mismatches = 0
        """... since start (the first one is logged)."""

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

    def image_data(self, input_ids: Sequence[int], media: Sequence[ImageFeatures]) -> list[str]:
        """The URLs of `media`, in order, for `/generate`'s `image_data`; one placeholder per image in `input_ids`."""
        placeholders = sum(1 for t in input_ids if t == self.image_token_id)
        if placeholders != len(media):
            raise ValueError(f"the prompt has {placeholders} image placeholder tokens (id {self.image_token_id}) "
                             f"for {len(media)} images")
        with self._lock:
            missing = [i for i, m in enumerate(media) if m.digest not in self._urls]
            if missing:
                raise ValueError(f"engine=sglang: image(s) {missing} of the prompt were not processed by this "
                                 "engine's `vision` (their URLs are unknown); the turn service must make the "
                                 "features with `engine.vision.features`")
            return [self._urls[m.digest] for m in media]

    def served(self, meta: dict[str, Any], length: int, url: str, refuse: bool = False) -> None:
        """Warn (once, then count) when SGLang served an image prompt of another length than `length` (see the
        module); `refuse` (engine.image_mismatch=refuse): fail instead."""
        served = meta.get("prompt_tokens")
        if served is None or int(served) == length:
            return
        self.mismatches += 1
        self.total_mismatches += 1
        if refuse:
            raise ValueError(f"SGLang server {url} served an image prompt as {served} tokens where this client "
                             f"expanded it to {length} (SGLang re-tokenizes image prompts): the sampled tokens do not "
                             "follow the recorded context; engine.image_mismatch=refuse refuses such turns (set "
                             "engine.image_mismatch=count to train on them, counted in engine/image_token_mismatches)")
        if self.total_mismatches == 1:
            log.warning("SGLang server %s served an image prompt as %s tokens where this client expanded it to %d: "
                        "it re-tokenizes the prompt's text, which does not round-trip for this prompt; its tokens "
                        "were sampled from a slightly different context than the one recorded (further cases are "
                        "counted in the step metric engine/image_token_mismatches)", url, served, length)

    def take_metrics(self) -> dict[str, float]:
        """`engine/image_token_mismatches`: image prompts served at another length since the last call; resets."""
        metrics, self.mismatches = {"engine/image_token_mismatches": float(self.mismatches)}, 0
        return metrics

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
