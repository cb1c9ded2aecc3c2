"""Build the tiny Qwen3-style model (`model=tiny`) that tests and CPU runs load like any HF checkpoint.

Contract: `build_tiny(cache_dir, seed)` returns a folder that `AutoTokenizer.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` load. It holds a byte-level BPE tokenizer trained on the shipped
`tiny_corpus.txt` (special tokens in `TINY_SPECIAL_TOKENS` are atomic; no BOS is ever added; decoding
round-trips any text), the chat template `tiny_template.jinja`, and a ~0.2 M parameter `Qwen3ForCausalLM`
with random float32 weights from `torch.manual_seed(seed)`. The build is deterministic and offline, and
is cached under `<cache_dir>/tiny-seed<seed>-<hash of builder version, corpus and template>`. Builders in
parallel processes each build into a temporary folder and publish it by an atomic rename; the first one
wins and the others discard their copy.

It deliberately does not train the model (its outputs are noise, which is all protocol and training
tests need), download anything, or handle images in the chat template (text parts only).
`QWEN3_DROP_REASONING_TEMPLATE` is the same template but drops the reasoning of assistant turns before
the last user query, like the real Qwen3 template; tests use it to show history-rewriting templates.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

BUILDER_VERSION = "1"
"""Bump when the build changes in a way the corpus and template hashes do not capture."""

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    "<|im_start|>",
    EOS_TOKEN,
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
)
"""Atomic special tokens, in id order (ids 0..8)."""

VOCAB_SIZE = 2048
"""Upper bound given to the BPE trainer; merges seen fewer than twice are dropped, so the shipped
corpus yields about 1.5 K tokens."""

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")
TEMPLATE_PATH = Path(__file__).with_name("tiny_template.jinja")
TINY_TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8")
_KEEP_SWITCH = "{%- set keep_all_reasoning = true %}"
QWEN3_DROP_REASONING_TEMPLATE = TINY_TEMPLATE.replace(_KEEP_SWITCH, "{%- set keep_all_reasoning = false %}")
if QWEN3_DROP_REASONING_TEMPLATE == TINY_TEMPLATE:
    raise RuntimeError(f"{TEMPLATE_PATH} must contain the line {_KEEP_SWITCH!r}")

BUILD_INFO = "relax_tiny.json"
"""Written last into a build; a folder without it is not a finished build."""
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", BUILD_INFO)
_SEED_LOCK = threading.Lock()
M = TypeVar("M", bound=PreTrainedModel)


def default_cache_dir() -> Path:
    """`$RELAX_CACHE_DIR`, else `~/.cache/relax_pipeline`."""
    env = os.environ.get("RELAX_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "relax_pipeline"


def content_hash() -> str:
    """Short hash of everything a build depends on besides the seed."""
    digest = hashlib.sha256(BUILDER_VERSION.encode())
    digest.update(CORPUS_PATH.read_bytes())
    digest.update(TINY_TEMPLATE.encode("utf-8"))
    return digest.hexdigest()[:12]


def tiny_dir(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """The folder `build_tiny` returns for these arguments (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root.expanduser() / f"tiny-seed{seed}-{content_hash()}"


def build_tiny(cache_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Return the cached tiny model folder for `seed`, building it first if it is missing."""
    return build_once(tiny_dir(cache_dir, seed), lambda folder: _build_into(folder, seed))


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final` when it holds a finished build, else `build` into a temporary folder published by rename."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a finished build."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def train_tokenizer(specials: tuple[str, ...] = TINY_SPECIAL_TOKENS, template: str = TINY_TEMPLATE
                    ) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the shipped corpus and wrap it with the chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(CORPUS_PATH)], trainer)
    return _wrap(tok, specials, template)


def _wrap(tok: Tokenizer, specials: tuple[str, ...], template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[t for t in specials if t not in (PAD_TOKEN, EOS_TOKEN)],
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def tiny_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    """The model shape: hidden 64, 2 layers, 4 query / 2 kv heads of 16, MLP 128, tied embeddings."""
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )


def init_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    """Random float32 weights from `torch.manual_seed(seed)`, leaving the caller's RNG state alone."""
    return seeded_model(lambda: Qwen3ForCausalLM(tiny_config(tokenizer)), tokenizer, seed)


def seeded_model(make: Callable[[], M], tokenizer: PreTrainedTokenizerFast, seed: int) -> M:
    """`make()` under `torch.manual_seed(seed)` (caller's RNG untouched), in float32 and eval mode, with
    the tokenizer's eos and pad ids as generation stops."""
    with _SEED_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make().to(torch.float32)
    ends = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config = GenerationConfig(eos_token_id=ends, pad_token_id=tokenizer.pad_token_id)
    return model.eval()


def _build_into(folder: Path, seed: int) -> None:
    tokenizer = train_tokenizer()
    model = init_model(tokenizer, seed)
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    info = {
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "content_hash": content_hash(),
        "vocab_size": len(tokenizer),
        "num_parameters": model.num_parameters(),
    }
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; losing the race to another builder is fine."""
    if final.exists() and not is_complete(final):
        shutil.rmtree(final, ignore_errors=True)  # debris from outside: builds only appear by rename
    try:
        tmp.rename(final)
    except OSError:
        if not is_complete(final):
            raise
