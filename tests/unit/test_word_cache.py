"""Word cache (`chat/words.py`): a text's ids joined from its words' kept ids equal the tokenizer's whole-text ids
(kept, learned, over budget, non-ASCII), and tokenizers where cutting into words is not exact get no cache.
"""

from __future__ import annotations

import json
import random
from typing import Any

from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.chat.words import GPT2_SPLIT, ascii_pattern, ascii_split, split_pattern


def _texts(count: int) -> list[str]:
    rng = random.Random(1)
    alphabet = [*"ab \n\t\r.,:;'\"{}[]()0123456789-_=", "'s", "'ll", " the", " city", "Record", "  ", "\n\n", " 1000",
                "ü", "東京", "\x0b", "\x1c"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def test_words_equal_whole_text_ids(template: ChatTemplate) -> None:
    words = template.codec.words
    assert words is not None, "the tiny tokenizer is byte-level BPE: the word cache must be on"
    whole = template.codec._encode
    for text in _texts(3000):
        assert words.encode(text) == whole(text), repr(text)
        assert words.encode(text) == whole(text), repr(text)  # now from kept words


def test_over_budget_starts_over_and_stays_exact(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    words = template.codec.words
    assert words is not None
    words.budget = 40
    longest = 0
    for text in _texts(300) + ["Record 3: the city had about 1003 residents. " * 5]:
        assert words.encode(text) == template.codec._encode(text), repr(text)
        longest = max(longest, len(text))
        assert words._chars <= max(words.budget, longest)  # a text longer than the budget is kept until the next


def test_non_ascii_is_encoded_whole(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    words = template.codec.words
    assert words is not None
    calls: list[str] = []
    encode = words._encode
    words._encode = lambda text: calls.append(text) or encode(text)  # type: ignore[method-assign]
    assert words.encode("café au lait") == encode("café au lait")
    assert words.encode("plain ascii") == encode("plain ascii")
    assert calls == ["café au lait"]


def test_delta_ids_through_words(template: ChatTemplate) -> None:
    text = "<|im_end|>\n<|im_start|>user\nRecord 7: the city had about 1007 residents.<|im_end|>\n"
    assert template.codec.encode(text) == template.tokenizer.encode(text, add_special_tokens=False)


def test_split_pattern_only_where_exact(tokenizer: Any) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert split_pattern(spec) == GPT2_SPLIT
    qwen_like = {**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}
    assert split_pattern(qwen_like) == "\\p{L}+|\\s+"
    assert split_pattern({**spec, "normalizer": {"type": "NFC"}}) is None
    assert split_pattern({**spec, "model": {**spec["model"], "dropout": 0.1}}) is None
    assert split_pattern({**spec, "pre_tokenizer": {"type": "Metaspace"}}) is None
    removed = {**qwen_like["pre_tokenizer"]["pretokenizers"][0], "behavior": "Removed"}
    assert split_pattern({**spec, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        removed, qwen_like["pre_tokenizer"]["pretokenizers"][1]]}}) is None


def test_words_are_the_tokenizers_own(tokenizer: Any) -> None:
    """On the texts the cache reads (ASCII but \x1c-\x1f) its words are the pre-tokenizer's, exactly."""
    words = ChatTemplate(tokenizer).codec.words
    assert words is not None
    pre = tokenizer.backend_tokenizer.pre_tokenizer
    rng = random.Random(2)
    alphabet = [*(chr(c) for c in range(128) if c not in range(0x1c, 0x20)), "'s", "'ll", "  ", "\n\n", " 1000"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ends = [end for _, (_, end) in pre.pre_tokenize_str(text)]
        cut = words._split(text)
        assert [sum(len(w) for w in cut[: i + 1]) for i in range(len(cut))] == ends, repr(text)


def test_a_long_text_is_encoded_whole_without_learning(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    words = template.codec.words
    assert words is not None
    text = "Record 3: the qzxv city. " * 400
    assert words.encode(text) == template.codec._encode(text)
    assert " qzxv" not in words._kept
    assert words.encode("the qzxv city") == template.codec._encode("the qzxv city")
    assert " qzxv" in words._kept


def test_a_few_new_words_are_encoded_one_by_one(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    words = template.codec.words
    assert words is not None
    base = "Record 3: the city had about 1003 residents."
    assert words.encode(base) == template.codec._encode(base)
    calls: list[str] = []
    encode_words = words._encode_words
    words._encode_words = lambda text: calls.append(text) or encode_words(text)  # type: ignore[method-assign]
    text = "Record 3: the city had about 2718 residents."
    assert words.encode(text) == template.codec._encode(text)
    assert calls == [" 2718"]


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_ascii_split_cuts_as_regex_does() -> None:
    """The `re` form of a word regex cuts every text the cache reads as Python's `regex` cuts it with the original."""
    import regex

    rng = random.Random(3)
    alphabet = [*(chr(c) for c in range(32, 127)), "\t", "\n", "\r", "'s", "'LL", "  ", "\n\n", " 1000", "\r\n "]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(3000)]
    for pattern in (GPT2_SPLIT, LLAMA3_SPLIT):
        fast, exact = ascii_split(pattern), regex.compile(pattern).findall
        assert fast is not None, pattern
        for text in texts:
            assert fast(text) == exact(text), (pattern, text)


def test_ascii_pattern_keeps_other_properties_in_regex() -> None:
    assert ascii_pattern(r"[^\s\p{L}]+| ?\p{N}") == r"[^\sA-Za-z]+| ?[0-9]"
    assert ascii_pattern(r"\p{M}+|\p{L}") is None
    assert ascii_pattern(r"\pL+") is None
    assert ascii_split(r"\p{Lu}+|.") is None


def test_texts_with_a_separator_or_non_ascii_are_encoded_whole(tokenizer: Any) -> None:
    from relax_pipeline.chat.words import SEPARATORS

    template = ChatTemplate(tokenizer)
    words = template.codec.words
    assert words is not None

    def no_split(text: str) -> list[str]:
        raise AssertionError(f"cut {text!r}")

    words._split = no_split  # type: ignore[method-assign]
    for text in [f"a{s}b c" for s in SEPARATORS] + ["ünï x"]:
        assert words.encode(text) == template.codec._encode(text)
