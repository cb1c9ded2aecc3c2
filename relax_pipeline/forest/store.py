"""SessionForest: the per-session tree of every model turn, recorded token-exactly.

A session's forest has one root per distinct (tools, chat_template_kwargs) context. Below a root,
observation nodes hold the messages a request added and their template tokens (loss 0), and response
nodes hold one generated assistant message with the engine's token ids, logprobs and weight versions
(loss 1). A node's `state_hash` is the chained hash of the canonical conversation up to its end.

Matching a request costs time linear in its size: the chained hashes of every prefix are computed
once and looked up in dicts (`match`). The deepest committed node state wins; the request's remaining
messages form the delta to tokenize. When the request shares a longer prefix with committed messages
than with committed node ends, or continues past a committed state differently from what was committed
there, a `ForkEvent` records the message index and what differed.

History policy (`reuse_visible`, `rollout.history=tokens`): many harnesses re-send an assistant turn
without the `reasoning_content` they were given. A re-sent assistant message that equals a committed
response in everything a harness can see (`Message.visible_key`: content, tool calls, images) continues
that response's lineage: the committed message, with its reasoning and tokens, replaces it in the match,
so the session stays linear and the model sees exactly what it generated. Without it (`render`) such a
request forks.

Token fields are stored compactly (about 4 bytes a token instead of a tuple's 36): ids and weight
versions as `array('i')`, logprobs as `array('f')` when every value is exactly a float32 (the engines
sample in float32, so this is the usual case) and as `array('d')` otherwise, so every logprob reads back
exactly as the engine gave it. Readers treat them as read-only sequences; `list(...)` gives plain values.
Empty fields (most of them: an observation has no logprobs, few nodes have versions that vary or
training ids of their own) share one empty array, which keeps the collector's work per turn down.

Two token views: `token_ids` are the inference ids (one unexpanded placeholder per image, what the
engine is given with the images); an observation that brought images also keeps them (`media`, the
processed features) and its processor-expanded `train_ids`, from which samples are built.

A turn touches the forest twice: `attach` (the match, moved to its attach point, with the lineage's ids,
its images when asked, and an identical observation already committed) before generating, and `commit`
(the observation, unless the request added nothing, and the response) after. The tree only grows: `commit`
adds nodes and never changes one. This module does not tokenize, render or generate; the turn service does
that between the two calls.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from relax_pipeline.canonical.form import Context, Message, chain, chain_all, chain_from
from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams

NodeKind = Literal["root", "observation", "response"]
IDS_CACHE_NODES = 8


def token_array(values: Iterable[int] = ()) -> array:
    """Token ids or weight versions as 4-byte C ints (what a node stores)."""
    return array("i", values)


def logprob_array(values: Sequence[float] = ()) -> array:
    """Logprobs as float32 when that is exact for every value (engines sample in float32), else float64."""
    single = array("f", values)
    return single if single.tolist() == list(values) else array("d", values)


NO_IDS = token_array()
NO_LOGPROBS = logprob_array()
"""The empty arrays that nodes share (never mutated, like every node array)."""


def stored_ids(values: Sequence[int]) -> array:
    """`token_array(values)`, or the shared empty array."""
    return token_array(values) if len(values) else NO_IDS


@dataclass(frozen=True, slots=True)
class GenerationPiece:
    """One engine call of a turn (a preempted turn has several); milliseconds from the turn's start."""

    start_ms: float
    end_ms: float
    first_token_ms: float | None = None
    """When its first token came (`GenerateResult.first_token_s`); None when the engine does not say."""


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """Where one model turn's time went; connects the turn service (which measures it) to the dump's
    `timing.turns` and the session traces (`stages/traces.py`). A preempted turn's parked time counts as queue."""

    queue_ms: float
    """Waiting to generate: the group's first-request barrier, a held or parked lease."""
    generation_ms: float
    """Inside the engine (its own admission queue included), summed over the pieces of a resumed turn."""
    total_ms: float
    """From the service taking the request to the turn being committed."""
    started_at: float = 0.0
    """Epoch seconds when the service took the request (0.0: not recorded)."""
    pieces: tuple[GenerationPiece, ...] = ()
    """The engine calls of the turn in order (not in the dump: the traces read them)."""

    def as_dict(self) -> dict[str, float]:
        return {"queue_ms": round(self.queue_ms, 3), "generation_ms": round(self.generation_ms, 3),
                "total_ms": round(self.total_ms, 3)}


@dataclass(frozen=True, slots=True)
class Node:
    """One committed step of a conversation; connects the turn service to samples and dumps."""

    id: int
    parent: int | None
    kind: NodeKind
    messages: tuple[Message, ...]
    token_ids: array
    """`array('i')`: the template's ids (observation) or the engine's generated ids (response)."""
    state_hash: bytes
    depth: int
    """Number of conversation messages from the root to the end of this node."""
    context: Context | None = None
    """Set on roots only."""
    logprobs: array = field(default_factory=lambda: NO_LOGPROBS)
    """One per generated token, exactly as the engine gave it (responses only)."""
    weight_versions: array = field(default_factory=lambda: NO_IDS)
    """The producing weight version of every generated token (responses only)."""
    sampling: SamplingParams | None = None
    finish_reason: str | None = None
    ends_turn: bool = True
    """False when a response stopped before the template's end-of-turn token (length, stop string)."""
    abort_count: int = 0
    created_at: float = field(default_factory=time.time)
    media: tuple[ImageFeatures, ...] = ()
    """Images this observation brought, in order (vision-language models only)."""
    train_ids: array = field(default_factory=lambda: NO_IDS)
    """Processor-expanded `token_ids` when the node has images; empty means the same as `token_ids`."""
    timing: TurnTiming | None = None
    """How long the turn queued and generated (responses committed by the turn service)."""

    @property
    def training_ids(self) -> array:
        """The ids a training sample holds for this node."""
        return self.train_ids or self.token_ids


@dataclass(frozen=True, slots=True)
class ForkEvent:
    """A request that diverged from the committed history; recorded on the session forest."""

    message_index: int
    """Index in the request's messages of the first message that differs (-1: tools/kwargs)."""
    differed: tuple[str, ...]
    """Which fields differed: role, content, reasoning_content, tool_calls, or tools/kwargs."""
    parent_node: int
    """Node the new branch attaches to."""
    role: str = ""
    """Role of the request's message at `message_index`."""
    at: float = field(default_factory=time.time)

    def describe(self) -> str:
        """One line for the log: where the request left the committed history and why."""
        if self.message_index < 0:
            return f"a new tree: its {' and '.join(self.differed)} differ from the session's first request"
        return (f"re-sent {self.role or 'a'} message {self.message_index} differs in {', '.join(self.differed)}; "
                f"new branch below node {self.parent_node}")


@dataclass(frozen=True, slots=True)
class Match:
    """Where a request attaches: its parent node and the messages that are new."""

    context: Context
    parent: Node | None
    """None when no root exists yet for the request's context."""
    delta: tuple[Message, ...]
    hashes: tuple[bytes, ...]
    fork: ForkEvent | None = None

    @property
    def full(self) -> bool:
        return not self.delta


@dataclass(frozen=True, slots=True)
class Attachment:
    """Where a turn attaches and what its prompt is built from; connects `attach` (before generating) to
    `commit` (after). Its parent is a root, a response, or an observation the request adds nothing to."""

    match: Match
    prompt_ids: array
    """Ids from the root to the end of the parent (empty below a root): a fresh array the caller may extend (no list
    of Python ints per turn: engines read any sequence)."""
    media: tuple[ImageFeatures, ...] = ()
    """Images from the root to the end of the parent, in order (when `attach` was asked for them)."""
    existing: Node | None = None
    """An observation already committed below the parent with the request's delta (its tokens are reused)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """The request's new messages as the model reads them; connects the turn service to `commit`."""

    token_ids: Sequence[int]
    """Inference ids (one placeholder per image)."""
    media: tuple[ImageFeatures, ...] = ()
    train_ids: Sequence[int] = ()
    """Processor-expanded ids when the observation has images; empty means the same as `token_ids`."""


class SessionForest:
    """All conversation trees of one session, with state-hash indexes for linear-time matching."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.children: dict[int, tuple[int, ...]] = {}  # -1: the roots; tuples of ints, which the collector untracks
        self.forks: list[ForkEvent] = []
        self._by_state: dict[bytes, int] = {}
        self._by_prefix: dict[bytes, tuple[int, int]] = {}
        self._ids_cache: dict[int, array] = {}
        self._by_visible: dict[bytes, int] = {}
        """Observation end state + a response's `visible_key` → that response node."""
        self._turns = 0

    def match(self, context: Context, messages: Sequence[Message], hashes: Sequence[bytes] = (),
              reuse_visible: bool = False) -> Match:
        """Find the deepest committed state the request extends (linear in the request size).

        `hashes` may carry the request's chained hashes when the caller already has them. With
        `reuse_visible`, re-sent assistant turns are matched by what a harness can see (see the module).
        """
        hashes = list(hashes) if len(hashes) == len(messages) + 1 else chain_all(context, messages)
        if reuse_visible and self._by_visible:
            messages, hashes = self._reuse_committed(messages, hashes)
        k = next((i for i in range(len(hashes) - 1, -1, -1) if hashes[i] in self._by_state), None)
        if k is None:
            fork = self._root_fork(context)
            return Match(context, None, tuple(messages), tuple(hashes), fork)
        parent = self.nodes[self._by_state[hashes[k]]]
        fork = self._divergence(hashes, messages, k, parent.id)
        return Match(context, parent, tuple(messages[k:]), tuple(hashes), fork)

    def attach(self, context: Context, messages: Sequence[Message], hashes: Sequence[bytes] = (),
               reuse_visible: bool = False, media: bool = False) -> Attachment:
        """Match a request (`match`) and gather what its prompt is built from, committing nothing.

        A request that extends an observation without its reply attaches above that observation (the
        observation is rendered again with the new messages). `media`: also collect the lineage's images.
        """
        match = self._attach_point(self.match(context, messages, hashes, reuse_visible))
        parent = match.parent
        before = self._lineage_media(parent) if media and parent is not None else ()
        if parent is None or parent.kind == "root":
            return Attachment(match, token_array(), before)
        existing = None if match.full else self._find_child(parent, match.hashes[-1])
        return Attachment(match, self._lineage_ids(parent)[:], before, existing)

    def _attach_point(self, match: Match) -> Match:
        """Attach below a response or root: an observation extended without a reply is re-rendered."""
        parent = match.parent
        if parent is None or parent.kind != "observation" or match.full:
            return match
        anchor = self.nodes[parent.parent] if parent.parent is not None else None
        return Match(match.context, anchor, parent.messages + match.delta, match.hashes, match.fork)

    def commit(self, attachment: Attachment, observation: Observation, message: Message, result: GenerateResult,
               sampling: SamplingParams, ends_turn: bool, timing: TurnTiming | None = None) -> Node:
        """Commit one turn: its observation below the attach point (none when the request added nothing; an
        identical one is reused) and the generated response below that. Returns the response node."""
        match = attachment.match
        if match.full and match.parent is not None:
            parent = match.parent
        else:
            parent = self._add_observation(match, observation)
        return self._add_response(parent, message, result, sampling, ends_turn, timing)

    def _root_fork(self, context: Context) -> ForkEvent | None:
        roots = self.children.get(-1, ())
        if not roots:
            return None
        other = self.nodes[roots[0]].context or Context()
        differed = tuple(
            name
            for name, a, b in (
                ("tools", context.tools, other.tools),
                ("chat_template_kwargs", context.kwargs(), other.kwargs()),
            )
            if a != b
        )
        return ForkEvent(-1, differed, -1)

    def _divergence(self, hashes: list[bytes], messages: Sequence[Message], k: int, parent: int) -> ForkEvent | None:
        m = k
        while m + 1 < len(hashes) and hashes[m + 1] in self._by_prefix:
            m += 1
        if m == len(messages):
            return None
        committed = self._next_committed(hashes[m])
        if committed is None:
            return None
        return ForkEvent(m, _differences(messages[m], committed), parent, messages[m].role)

    def _committed(self, state: bytes) -> bool:
        return state in self._by_state or state in self._by_prefix

    def _first_uncommitted(self, hashes: Sequence[bytes]) -> int:
        """Index of the first message whose end state is not committed (binary search: committed states
        are closed under prefixes, since every prefix of a committed lineage is committed)."""
        return bisect_left(range(len(hashes) - 1), True, key=lambda i: hashes[i + 1] not in self._by_prefix
                           and hashes[i + 1] not in self._by_state)

    def _reuse_committed(self, messages: Sequence[Message], hashes: list[bytes]
                         ) -> tuple[Sequence[Message], list[bytes]]:
        """Replace re-sent assistant messages that equal a committed response in what is visible by that
        response's message, and re-chain the hashes after the first replacement (one forward pass)."""
        i = self._first_uncommitted(hashes)
        if i == len(messages):
            return messages, hashes
        out, changed = list(messages), False
        while i < len(out):
            after = chain(hashes[i], out[i]) if changed else hashes[i + 1]
            if not self._committed(after) and out[i].role == "assistant":
                node_id = self._by_visible.get(hashes[i] + out[i].visible_key())
                if node_id is not None:
                    out[i], after, changed = self.nodes[node_id].messages[0], self.nodes[node_id].state_hash, True
            if not self._committed(after):
                break
            hashes[i + 1] = after
            i += 1
        if changed:
            for j in range(i, len(out)):
                hashes[j + 1] = chain(hashes[j], out[j])
        return out, hashes

    def _next_committed(self, prefix: bytes) -> Message | None:
        """The committed message that follows the prefix state `prefix`, if any."""
        located = self._by_prefix.get(prefix)
        if located is None:
            node_id = self._by_state.get(prefix)
            offset = None
        else:
            node_id, offset = located
        if node_id is None:
            return None
        node = self.nodes[node_id]
        if offset is not None and offset + 1 < len(node.messages):
            return node.messages[offset + 1]
        for child in self.children.get(node.id, ()):
            if self.nodes[child].messages:
                return self.nodes[child].messages[0]
        return None

    def _find_child(self, parent: Node | None, state_hash: bytes) -> Node | None:
        """An existing observation child with this end state (identical delta), to reuse its tokens."""
        node_id = self._by_state.get(state_hash)
        if node_id is None:
            return None
        node = self.nodes[node_id]
        parent_id = parent.id if parent is not None else None
        if node.kind == "observation" and node.parent == parent_id:
            return node
        return None

    def add_root(self, context: Context) -> Node:
        state = context.root_hash
        if state in self._by_state:
            return self.nodes[self._by_state[state]]
        return self._add(Node(len(self.nodes), None, "root", (), NO_IDS, state, 0, context=context))

    def _add_observation(self, match: Match, observation: Observation) -> Node:
        """Commit the request's delta messages below its parent (reusing an identical one)."""
        parent = match.parent or self.add_root(match.context)
        if match.fork is not None:
            self.forks.append(match.fork)
        state = match.hashes[-1]
        existing = self._find_child(parent, state)
        if existing is not None:
            return existing
        node = Node(len(self.nodes), parent.id, "observation", match.delta, token_array(observation.token_ids),
                    state, parent.depth + len(match.delta), media=observation.media,
                    train_ids=stored_ids(observation.train_ids))
        return self._add(node, match.hashes[len(match.hashes) - len(match.delta):])

    def _add_response(
        self, parent: Node, message: Message, result: GenerateResult, sampling: SamplingParams, ends_turn: bool,
        timing: TurnTiming | None = None,
    ) -> Node:
        """Commit one generated assistant turn below an observation node."""
        node = Node(
            len(self.nodes), parent.id, "response", (message,), token_array(result.output_ids),
            chain(parent.state_hash, message), parent.depth + 1, logprobs=logprob_array(result.logprobs),
            weight_versions=stored_ids(result.token_versions), sampling=sampling,
            finish_reason=result.finish_reason, ends_turn=ends_turn, abort_count=result.abort_count, timing=timing,
        )
        return self._add(node, (node.state_hash,))

    def _add(self, node: Node, states: Sequence[bytes] = ()) -> Node:
        """Add `node`; `states`: the state after each of its messages when the caller has them (else chained)."""
        self.nodes.append(node)
        self._turns += node.kind == "response"
        self.children[up] = self.children.get(up := -1 if node.parent is None else node.parent, ()) + (node.id,)
        self._by_state.setdefault(node.state_hash, node.id)
        self._index_prefixes(node, states)
        if node.kind == "response" and node.parent is not None:
            self._by_visible.setdefault(self.nodes[node.parent].state_hash + node.messages[0].visible_key(), node.id)
        return node

    def _index_prefixes(self, node: Node, states: Sequence[bytes] = ()) -> None:
        if node.parent is None:
            return
        if len(states) != len(node.messages) or states and states[-1] != node.state_hash:
            states = chain_from(self.nodes[node.parent].state_hash, node.messages)
        for offset, state in enumerate(states):
            self._by_prefix.setdefault(state, (node.id, offset))

    def lineage(self, node: Node) -> list[Node]:
        """Nodes from the root down to `node`, inclusive."""
        path = [node]
        while path[-1].parent is not None:
            path.append(self.nodes[path[-1].parent])
        path.reverse()
        return path

    def prompt_ids(self, node: Node) -> list[int]:
        """All token ids from the root to the end of `node`.

        The ids of recently used nodes are kept (a few per session), so a turn copies its lineage's
        tokens once instead of walking every earlier node. A kept lineage moves down to the descendant
        that extends it unless it is a branch point, so a linear session keeps one copy of its tokens.
        """
        return self._lineage_ids(node).tolist()

    def _lineage_ids(self, node: Node) -> array:
        """`prompt_ids` as the kept array itself (the caller copies it before changing it)."""
        path: list[Node] = []
        cursor: Node | None = node
        while cursor is not None and cursor.id not in self._ids_cache:
            path.append(cursor)
            cursor = self.nodes[cursor.parent] if cursor.parent is not None else None
        if not path:
            return self._ids_cache[node.id]
        ids = self._base_ids(cursor)
        for step in reversed(path):
            ids.extend(step.token_ids)
        self._remember_ids(node.id, ids)
        return ids

    def _base_ids(self, cursor: Node | None) -> array:
        """The kept ids of `cursor` to extend: taken over unless it is a branch point, then copied."""
        if cursor is None:
            return token_array()
        if len(self.children.get(cursor.id, ())) > 1:
            return self._ids_cache[cursor.id][:]
        return self._ids_cache.pop(cursor.id)

    def _remember_ids(self, node_id: int, ids: array) -> None:
        self._ids_cache[node_id] = ids
        if len(self._ids_cache) > IDS_CACHE_NODES:
            del self._ids_cache[next(iter(self._ids_cache))]

    def _lineage_media(self, node: Node) -> tuple[ImageFeatures, ...]:
        """Every image from the root to the end of `node`, in order."""
        return tuple(image for step in self.lineage(node) for image in step.media)

    def history(self, node_id: int) -> tuple[Message, ...]:
        """The conversation from the root to the end of node `node_id`, inclusive."""
        return tuple(message for node in self.lineage(self.nodes[node_id]) for message in node.messages)

    def leaves(self) -> list[Node]:
        """Response nodes without children: the exportable ends of the conversation trees."""
        return [n for n in self.nodes if n.kind == "response" and not self.children.get(n.id)]

    def node_for_state(self, state_hash: bytes) -> Node | None:
        node_id = self._by_state.get(state_hash)
        return None if node_id is None else self.nodes[node_id]

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading messages of a hashed conversation match committed messages."""
        m = 0
        while m + 1 < len(hashes) and (hashes[m + 1] in self._by_prefix or hashes[m + 1] in self._by_state):
            m += 1
        return m

    def next_committed(self, hashes: Sequence[bytes], index: int) -> Message | None:
        return self._next_committed(hashes[index])

    @property
    def turn_count(self) -> int:
        """Committed response nodes (generated turns), kept as nodes are added."""
        return self._turns


def _differences(request: Message, committed: Message) -> tuple[str, ...]:
    fields = ("role", "content", "reasoning_content", "tool_calls")
    diff = tuple(f for f in fields if _field(request, f) != _field(committed, f))
    return diff or ("tool_call_id",)


def _field(message: Message, name: str) -> object:
    if name == "tool_calls":
        return [c.key() for c in message.tool_calls]
    return getattr(message, name)
