"""Build the tiny Qwen2-VL-style vision-language model (`model=tiny_vl`), offline, like `tiny`.

Contract: `build_tiny_vl(cache_dir, seed)` returns a folder holding the tiny BPE tokenizer (the `tiny`
corpus, plus the Qwen2-VL vision tokens `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`,
`<|video_pad|>`), a chat template that writes `<|vision_start|><|image_pad|><|vision_end|>` for every
image part (one unexpanded placeholder per image; otherwise the `tiny` template), the PIL image processor
(`preprocessor_config.json`: 4-pixel patches, 2×2 merge, at most 64×64 pixels, so an image costs 1 to 64
placeholder tokens) and a ~0.2 M parameter `Qwen2VLForConditionalGeneration` (one vision block of width
32 feeding the `tiny` text shape; mrope sections [2, 3, 3] for head dim 16) with random float32 weights
from `torch.manual_seed(seed)`. Cached and published atomically exactly like `tiny`.

Like `tiny`, it is untrained (outputs are noise) and downloads nothing; it exists so the multimodal path
(placeholders, mrope positions, pixel inputs, expanded training ids) runs end to end on CPU.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

from relax_pipeline.models.tiny import (
    BUILD_INFO,
    TINY_SPECIAL_TOKENS,
    TINY_TEMPLATE,
    build_once,
    content_hash,
    default_cache_dir,
    seeded_model,
    train_tokenizer,
)

VL_BUILDER_VERSION = "1"
VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN = "<|image_pad|>"
IMAGE_MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"
_TEXT_PART = """            {%- if part is mapping and part.get('type', 'text') == 'text' %}
                {{- part.get('text', '') }}
"""
_IMAGE_PART = _TEXT_PART + """            {%- elif part is mapping and part.get('type') in ('image', 'image_url') %}
                {{- '""" + IMAGE_MARKUP + """' }}
"""
TINY_VL_TEMPLATE = TINY_TEMPLATE.replace(_TEXT_PART, _IMAGE_PART)
if TINY_VL_TEMPLATE == TINY_TEMPLATE:
    raise RuntimeError("tiny_template.jinja changed: update _TEXT_PART in tiny_vl.py")
PATCH_SIZE = 4
MERGE_SIZE = 2
MIN_PIXELS = 8 * 8
MAX_PIXELS = 64 * 64


def tiny_vl_dir(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The folder `build_tiny_vl` returns for these arguments (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256((VL_BUILDER_VERSION + content_hash() + TINY_VL_TEMPLATE).encode()).hexdigest()[:12]
    return root.expanduser() / f"tiny_vl-seed{seed}-{digest}"


def build_tiny_vl(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the cached tiny vision-language model folder for `seed`, building it if it is missing."""
    return build_once(tiny_vl_dir(cache_dir, seed), lambda folder: _build_into(folder, seed))


def image_processor() -> object:
    """The PIL Qwen2-VL image processor with the tiny patch sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, temporal_patch_size=2, merge_size=MERGE_SIZE,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})


def tiny_vl_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2VLConfig:
    """The `tiny` text shape plus one small vision block; special token ids from the tokenizer."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, in_channels=3)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)


def init_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2VLForConditionalGeneration:
    """Random float32 weights from `torch.manual_seed(seed)`, leaving the caller's RNG state alone."""
    return seeded_model(lambda: Qwen2VLForConditionalGeneration(tiny_vl_config(tokenizer)), tokenizer, seed)


def _build_into(folder: Path, seed: int) -> None:
    tokenizer = train_tokenizer(TINY_SPECIAL_TOKENS + VISION_TOKENS, TINY_VL_TEMPLATE)
    model = init_model(tokenizer, seed)
    tokenizer.save_pretrained(folder)
    image_processor().save_pretrained(folder)  # type: ignore[attr-defined]
    model.save_pretrained(folder)
    info = {"builder_version": VL_BUILDER_VERSION, "seed": seed, "vocab_size": len(tokenizer),
            "num_parameters": model.num_parameters(), "image_token_id": model.config.image_token_id}
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
