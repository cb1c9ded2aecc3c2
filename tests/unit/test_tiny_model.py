"""Tests for `relax_pipeline.models.tiny`: the cached, deterministic tiny model and its chat template.

Everything runs for real on CPU: the tokenizer is trained, the model built, saved, loaded through the
`Auto*` classes and run. Golden strings below are the template's exact output; if the template changes
on purpose, print `tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)` and paste it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relax_pipeline.models.tiny import (
    BUILD_INFO,
    QWEN3_DROP_REASONING_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    build_tiny,
    default_cache_dir,
    tiny_dir,
)

Message = dict[str, Any]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 + 7"}}}
CONVERSATION: list[Message] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "reasoning_content": "Use the calculator.", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "19"},
    {"role": "assistant", "content": "12 + 7 = 19."},
]
GOLDEN_CONVERSATION = (
    "<|im_start|>system\nYou are helpful.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nUse the calculator.\n</think>\n\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n12 + 7 = 19.<|im_end|>\n"
)
TWO_QUERIES: list[Message] = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "reasoning_content": "Add.", "content": "4"},
]
ROUND_TRIP = [
    '<|im_start|>user\nHello  world {"a": [1, 2.5, null]}<|im_end|>\n',
    "  café 東京 😀\n\n\t<think>x</think> <tool_call>\n{}</tool_call>",
    " leading space and trailing  ",
    "a<|im_end|> b<|endoftext|><tool_response>\n\r\n</tool_response>",
    "<|im_start|<|im_start|>>",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("cache"), seed=0)


@pytest.fixture(scope="module")
def tok(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def render(tok: PreTrainedTokenizerBase, messages: list[Message], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_build_is_cached(tmp_path: Path) -> None:
    first = build_tiny(tmp_path, seed=3)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(tmp_path, seed=3) == first == tiny_dir(tmp_path, seed=3)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name.startswith("tiny-seed3-") and (first / BUILD_INFO).is_file()


def test_build_is_deterministic_per_seed(folder: Path, tmp_path: Path) -> None:
    again, other = build_tiny(tmp_path / "a", seed=0), build_tiny(tmp_path / "b", seed=1)
    for name in ("tokenizer.json", "model.safetensors", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (folder / "model.safetensors").read_bytes()


def test_concurrent_builds_agree(tmp_path: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: build_tiny(tmp_path, seed=0), range(4)))
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    assert AutoTokenizer.from_pretrained(paths[0]) is not None


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path and tiny_dir(seed=2).parent == tmp_path
    monkeypatch.delenv("RELAX_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "relax_pipeline"


def test_model_shape(model: torch.nn.Module, tok: PreTrainedTokenizerBase) -> None:
    assert 100_000 <= model.num_parameters() <= 400_000
    assert model.config.vocab_size == len(tok) and model.config.model_type == "qwen3"
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]


def test_special_tokens_are_atomic(tok: PreTrainedTokenizerBase) -> None:
    ids = [tok.encode(t, add_special_tokens=False) for t in TINY_SPECIAL_TOKENS]
    assert ids == [[i] for i in range(len(TINY_SPECIAL_TOKENS))]
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>" and tok.bos_token is None
    assert tok.encode("hi there") == tok.encode("hi there", add_special_tokens=False)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_decode_round_trips(tok: PreTrainedTokenizerBase, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_golden_conversation(tok: PreTrainedTokenizerBase) -> None:
    assert render(tok, CONVERSATION, tools=TOOLS) == GOLDEN_CONVERSATION


def test_small_case_and_generation_prompts(tok: PreTrainedTokenizerBase) -> None:
    user = [{"role": "user", "content": "Hi"}]
    assert render(tok, user) == "<|im_start|>user\nHi<|im_end|>\n"
    prompt = render(tok, user, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    no_think = render(tok, user, add_generation_prompt=True, enable_thinking=False)
    assert no_think == prompt + "<think>\n\n</think>\n\n"
    assert render(tok, user, add_generation_prompt=True, enable_thinking=True) == prompt


def test_calls_parts_and_grouped_tool_responses(tok: PreTrainedTokenizerBase) -> None:
    raw = {"name": "search", "arguments": '{"query": "x"}'}
    messages: list[Message] = [
        {"role": "user", "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "Sure.", "tool_calls": [CALL, raw]},
        {"role": "tool", "content": "19"},
        {"role": "tool", "content": [{"type": "text", "text": "found"}]},
    ]
    assert render(tok, messages) == (
        "<|im_start|>user\nFind x<|im_end|>\n<|im_start|>assistant\nSure.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n19\n</tool_response>\n<tool_response>\nfound\n</tool_response>"
        "<|im_end|>\n"
    )


def test_no_tools_system_block(tok: PreTrainedTokenizerBase) -> None:
    expected = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
    assert render(tok, CONVERSATION[:2]) == expected


def is_append_only(tok: PreTrainedTokenizerBase, messages: list[Message], **kwargs: Any) -> bool:
    whole = render(tok, messages, **kwargs)
    return all(whole.startswith(render(tok, messages[:k], **kwargs)) for k in range(1, len(messages)))


def test_reasoning_is_kept_in_history(tok: PreTrainedTokenizerBase) -> None:
    assert is_append_only(tok, TWO_QUERIES) and is_append_only(tok, CONVERSATION, tools=TOOLS)
    assert render(tok, TWO_QUERIES).count("<think>") == 2


def test_drop_reasoning_template_rewrites_history(tok: PreTrainedTokenizerBase) -> None:
    dropped = render(tok, TWO_QUERIES, chat_template=QWEN3_DROP_REASONING_TEMPLATE)
    assert dropped.count("<think>") == 1 and "Greet back." not in dropped
    assert not is_append_only(tok, TWO_QUERIES, chat_template=QWEN3_DROP_REASONING_TEMPLATE)
    same = render(tok, CONVERSATION, tools=TOOLS, chat_template=QWEN3_DROP_REASONING_TEMPLATE)
    assert same == GOLDEN_CONVERSATION


def test_forward_and_generate(model: torch.nn.Module, tok: PreTrainedTokenizerBase) -> None:
    ids = tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    assert out.shape == (1, ids.shape[1] + 4) and torch.equal(out[:, : ids.shape[1]], ids)
