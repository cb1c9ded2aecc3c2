"""Token ids of plain text through a per-word cache, where a byte-level BPE tokenizer makes that exact.

A byte-level BPE tokenizer (GPT-2, SmolLM2, Qwen, Llama 3) first cuts a text into words with one regular
expression (its pre-tokenizer) and then encodes every word on its own: no merge crosses a word boundary. So
the ids of a text are its words' ids joined, and a word seen before needs no tokenizer call. A turn's delta
(a tool result, a user message) is mostly words seen before, and one call of the Rust tokenizer costs more
than looking up all of them (docs/benchmarks.md, "Gateway").

`Words.of` builds the cache only for a tokenizer where this is exact by construction: no normalizer, a BPE
model without dropout, and a pre-tokenizer that is the GPT-2 `ByteLevel` regex or one `Split` regex (isolated,
not inverted) followed by a `ByteLevel` that adds no prefix space; and then only if it agrees with whole-text
encodes on probes. Words are cut with the tokenizer's own regex (the same leftmost-first semantics), and `encode`
still encodes the whole text with the tokenizer when the text holds anything but ASCII, or one of the separators
\\x1c-\\x1f (where two regex engines disagree on a character class: `re` calls them whitespace, Unicode does not), or
when the words do not join back to the text. Since it only cuts such texts, the regex runs in the standard library's
`re` with `\\p{L}` and `\\p{N}` written as their ASCII members (`ascii_pattern`; faster than Python's `regex` on
long texts, which a first turn's history is), where both cut the probes and every character it reads
alike; a pattern naming any other Unicode property runs in `regex`.
A text with a word not seen before is encoded whole in one call (what it cost
before), whose tokens' word indices give every word's ids to keep (texts up to `LEARN_CHARS`, and only when the
tokenizer cut as many words), unless it misses at most `FEW_WORDS` words: those are encoded one by one. The cache
forgets everything once it holds `budget` characters.

It does not split at added tokens (`codec.Pieces` does that first) and does not decode.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable, Sequence
from typing import Any

Encode = Callable[[str], list[int]]
"""Text → token ids."""
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The regex `ByteLevel(use_regex=True)` cuts words with."""
EncodeWords = Callable[[str], tuple[list[int], list[int | None]]]
"""Text → token ids and each token's word index (the tokenizer's own pre-tokenizer words)."""
FEW_WORDS = 3
"""A text missing at most this many words encodes each of them on its own (cheaper than the whole text)."""
LEARN_CHARS = 4096
"""Longer texts with unknown words are encoded whole without learning their words (grouping costs Python time)."""
WORD_CACHE_CHARS = 1 << 21
"""Characters of words kept (2 Mi, a few MiB) before the cache starts over."""
SEPARATORS = ("\x1c", "\x1d", "\x1e", "\x1f")
"""ASCII characters `re` reads as whitespace and Unicode does not: texts with one (or with non-ASCII) are encoded
whole."""
_ASCII_MEMBERS = {"\\p{L}": "A-Za-z", "\\p{N}": "0-9"}
"""The members of the Unicode letters and numbers among the characters the cache reads."""
ASCII_TEXT = "".join(chr(c) for c in range(128) if chr(c) not in SEPARATORS)
"""Every character the cache reads."""
PROBES = ("Hello world", " it's  done\n\n", "x = [1, 2, 345678]; y='ab' \t z", "I'LL  we've\r\n  \n a",
          '{"city": "Oslo-3", "year": 2000}', "   leading", "trailing   ", "a\n\n\n b  c\t\td", "1234567 12 x1y2",
          "Record 3: the city had about 1003 residents at the last census, according to the registry.",
          "a\x00b\x7f c\x0b\x0cd\x1b[0m \x08")


class Words:
    """Ids of texts as their words' ids joined, the ids of every word seen kept (see the module)."""

    def __init__(self, split: Callable[[str], list[str]], encode_words: EncodeWords, encode: Encode,
                 budget: int = WORD_CACHE_CHARS) -> None:
        self._split = split
        self._encode_words = encode_words
        self._encode = encode
        self._kept: dict[str, array] = {}
        self._chars = 0
        self.budget = budget

    @classmethod
    def of(cls, backend: Any, encode: Encode) -> Words | None:
        """The cache for the Rust tokenizer `backend` (whole texts through `encode`), or None where not exact."""
        try:
            import regex

            pattern = split_pattern(json.loads(backend.to_str()))
            if pattern is None:
                return None
            split = ascii_split(pattern) or regex.compile(pattern).findall
        except Exception:  # noqa: BLE001 - an unknown tokenizer layout or a regex Python cannot read: no cache
            return None

        def encode_words(text: str) -> tuple[list[int], list[int | None]]:
            encoding = backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.word_ids

        words = cls(split, encode_words, encode)
        return words if words.agrees() else None

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no added tokens in it): its words' kept ids, else one call that also learns them."""
        ids = self.ids(text)
        return ids if type(ids) is list else ids.tolist()

    def ids(self, text: str) -> Sequence[int]:
        """`encode` as an array of C ints when every word is kept (no Python int per token), else a list."""
        if not text.isascii() or "\x1c" in text or "\x1d" in text or "\x1e" in text or "\x1f" in text:  # SEPARATORS
            return self._encode(text)
        words = self._split(text)
        if "".join(words) != text:
            return self._encode(text)
        kept, ids = self._kept, array("i")
        try:
            for word in words:
                ids += kept[word]
        except KeyError:
            return self._fill(text, words)
        return ids

    def _fill(self, text: str, words: list[str]) -> list[int]:
        """`encode` for a text with words not kept: a few are encoded one by one, more through `_learn`."""
        kept = self._kept
        missing = list(dict.fromkeys(w for w in words if w not in kept))
        if len(missing) > FEW_WORDS:
            return self._learn(text, words)
        new = {w: self._encode_words(w)[0] for w in missing}
        ids: list[int] = []
        for word in words:
            ids += new.get(word) or kept[word]
        self._keep(missing, list(new.values()), sum(map(len, missing)))
        return ids

    def _learn(self, text: str, words: list[str]) -> list[int]:
        """The ids of `text` in one call; its tokens grouped by word are its words' ids (kept for a short text)."""
        if len(text) > LEARN_CHARS:
            return self._encode(text)
        ids, word_ids = self._encode_words(text)
        if not ids or None in word_ids or word_ids[-1] != len(words) - 1:  # the tokenizer cut as many words
            return ids
        groups: list[list[int]] = [[] for _ in words]
        for token, word in zip(ids, word_ids, strict=True):
            groups[word].append(token)  # type: ignore[index]
        if all(groups):
            self._keep(words, groups, len(text))
        return ids

    def _keep(self, words: list[str], ids: list[list[int]], chars: int) -> None:
        if self._chars + chars > self.budget:
            self._kept.clear()
            self._chars = 0
        self._kept.update(zip(words, map(_int_array, ids), strict=True))
        self._chars += chars

    def agrees(self) -> bool:
        """Whether word-joined ids equal whole-text encodes on the probes (each twice: learning, then kept)."""
        try:
            return all(self.encode(text) == self._encode(text) for text in PROBES + PROBES)
        except Exception:  # noqa: BLE001 - any failure means: encode whole texts
            return False
        finally:
            self._kept.clear()
            self._chars = 0


def _int_array(ids: list[int]) -> array:
    return array("i", ids)


def ascii_pattern(pattern: str) -> str | None:
    """`pattern` for `re` on the texts the cache cuts: `\\p{L}` and `\\p{N}` as `A-Za-z` and `0-9` (in a class or as
    one); None when it names any other Unicode property."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        atom = pattern[i : i + 5] if pattern[i] == "\\" else pattern[i]
        if atom in _ASCII_MEMBERS:
            out.append(_ASCII_MEMBERS[atom] if in_class else f"[{_ASCII_MEMBERS[atom]}]")
            i += len(atom)
            continue
        if atom[:2] in ("\\p", "\\P"):
            return None
        step = 2 if atom[0] == "\\" else 1  # an escape is copied whole: `\\[` opens no class
        if step == 1 and atom in "[]":
            in_class = atom == "["
        out.append(pattern[i : i + step])
        i += step
    return "".join(out)


def ascii_split(pattern: str) -> Callable[[str], list[str]] | None:
    """`re`'s findall of `ascii_pattern(pattern)` where it cuts the probes and every character the cache reads as
    `regex` cuts them with `pattern`; else None."""
    try:
        import regex

        translated = ascii_pattern(pattern)
        if translated is None:
            return None
        fast, exact = re.compile(translated).findall, regex.compile(pattern).findall
    except Exception:  # noqa: BLE001 - a pattern `re` cannot read: `regex` cuts
        return None
    texts = (*PROBES, ASCII_TEXT, ASCII_TEXT[::-1], " ".join(ASCII_TEXT), "\n ".join(ASCII_TEXT))
    return fast if all(fast(text) == exact(text) for text in texts) else None


def split_pattern(spec: dict[str, Any]) -> str | None:
    """The word regex of a tokenizer's JSON `spec`, or None when cutting into words that way is not exact."""
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or model.get("type") != "BPE" or model.get("dropout") is not None:
        return None
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return GPT2_SPLIT if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    cut, byte_level = steps
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    if cut.get("type") != "Split" or cut.get("behavior") != "Isolated" or cut.get("invert"):
        return None
    return (cut.get("pattern") or {}).get("Regex")
