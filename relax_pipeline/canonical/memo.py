"""The session memo: a session's few latest requests, so a replayed history is canonicalized once.

`RequestMemo` reuses a session's replayed history: it keeps the session's few latest requests (decoded JSON
items, canonical messages, chained hashes) and, for a new request, takes the messages and hashes of the
longest run of equal leading items (plain `==` on decoded JSON, done in C) from them, so only the new items
are canonicalized and hashed (the same result: canonicalization is a pure function of an item) and a
turn's Python work does not grow with the turns before it. A context whose decoded JSON equals the previous
request's is the previous `Context` object, so its tools are not hashed again. It keeps references to the
items (no copies), forgets the oldest entry when full, and takes the parse function from its caller.

It parses no request bodies (the protocol front-ends do) and validates nothing itself (`form.py` does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import Context, Message, chain

ParseItem = Callable[[Any, str], Message]
BuildContext = Callable[[], Context]


@dataclass(frozen=True, slots=True)
class _Entry:
    items: list[Any]
    messages: tuple[Message, ...]
    hashes: tuple[bytes, ...]
    """Chained hashes `[root, after m0, ...]` under the entry's context."""


class RequestMemo:
    """A session's recent requests, reused by common prefix."""

    def __init__(self, size: int = 4) -> None:
        self._entries: deque[_Entry] = deque(maxlen=max(size, 1))
        self._enabled = size > 0
        self._context: tuple[Any, Context] | None = None

    def context(self, raw: Any, build: BuildContext) -> Context:
        """`build()`, or the previous request's context when its `raw` equals this one's (the decoded JSON
        of its tools and kwargs, tagged with the front-end, whose builder may read them its own way)."""
        if self._context is not None and self._context[0] == raw:
            return self._context[1]
        context = build()
        if self._enabled:
            self._context = (raw, context)
        return context

    def canonical(self, items: list[Any], context: Context, parse: ParseItem, param: str = "messages"
                  ) -> tuple[tuple[Message, ...], tuple[bytes, ...]]:
        """Canonical messages and chained hashes of `items`, reusing the best cached prefix."""
        entry, n = self._best(items)
        new = tuple([parse(items[i], f"{param}[{i}]") for i in range(n, len(items))])
        messages = entry.messages[:n] + new if entry else new
        same_root = entry is not None and entry.hashes[0] == context.root_hash
        known = entry.hashes[: n + 1] if same_root else (context.root_hash,)
        state, more = known[-1], []
        for message in messages[len(known) - 1 :]:
            state = chain(state, message)
            more.append(state)
        result = _Entry(items, messages, known + tuple(more))
        if self._enabled:
            self._entries.append(result)
        return result.messages, result.hashes

    def _best(self, items: list[Any]) -> tuple[_Entry | None, int]:
        """Newest entries first; stop once all but the last two items are covered."""
        best, best_n = None, 0
        for entry in reversed(self._entries):
            n = _common_prefix(entry.items, items)
            if n > best_n:
                best, best_n = entry, n
            if best_n >= len(items) - 2:
                break
        return best, best_n


def _common_prefix(a: list[Any], b: list[Any]) -> int:
    """Length of the longest common prefix, by slice comparisons (C loops; the full-prefix case is one)."""
    lo, hi = 0, min(len(a), len(b))
    if hi and a[: hi - 1] == b[: hi - 1]:  # the usual case: a replay that extends or retries a request
        return hi if a[hi - 1] == b[hi - 1] else hi - 1
    hi -= 2
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi+1] != b[:hi+1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
