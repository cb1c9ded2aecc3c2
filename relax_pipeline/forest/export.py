"""Export matching: which committed states of a session become training contexts.

Implicit export (the agent wrote no records) takes the single exportable leaf of a linear history. A
forked session (a harness that rewrote its history) exports every root-to-leaf chain as its own context
under `export.implicit=leaves` (the default): chains in leaf order, each with its `branch` index, and
each generated turn trained once, in the first chain that holds it (`Exported.shared` names the response
nodes an earlier chain already trains). `export.implicit=strict` refuses a forked session with a message
naming every leaf and every recorded fork. Explicit records are canonicalized
like requests and must end exactly on a committed state that holds at least one generated turn; a record
that does not is reported with the closest committed state and the first message index where it diverges.
Names must be non-empty and unique (checked when the output file is read). `ExportRecord`, one explicit record,
is the agent contract's (`agent/session_io.py`, which parses the agent's output file into it). This module builds
no samples (`sample.py`) and reads no files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from relax_pipeline.agent.session_io import ExportRecord
from relax_pipeline.canonical.form import (
    CanonicalError,
    Context,
    canonical_template_kwargs,
    canonical_tools,
    chain_all,
    parse_messages,
)
from relax_pipeline.forest.store import Node, SessionForest


class ExportError(ValueError):
    """An export that matches no committed state; the text says where it diverged."""


IMPLICIT_MODES = ("leaves", "strict")


@dataclass(frozen=True)
class Exported:
    """One exported context: the record (None for implicit) and the node it ends on."""

    name: str | None
    node: Node
    record: ExportRecord | None = None
    branch: int | None = None
    """Which root-to-leaf chain of a forked session this is (implicit `leaves` export); None otherwise."""
    shared: frozenset[int] = frozenset()
    """Response nodes of this chain that an earlier chain of the same session already trains."""


def implicit_exports(forest: SessionForest, mode: str = "leaves") -> list[Exported]:
    """The implicit contexts of a session: its one leaf, or every chain of a forked session (`leaves`)."""
    leaves = forest.leaves()
    if len(leaves) <= 1 or mode == "strict":
        return [implicit_export(forest)]
    out: list[Exported] = []
    trained: set[int] = set()
    for branch, leaf in enumerate(leaves):
        responses = {n.id for n in forest.lineage(leaf) if n.kind == "response"}
        out.append(Exported(None, leaf, None, branch, frozenset(responses & trained)))
        trained |= responses
    return out


def implicit_export(forest: SessionForest) -> Exported:
    """The single leaf of a linear history (`export.implicit=strict`)."""
    leaves = forest.leaves()
    if not leaves:
        raise ExportError("the agent made no model call, so there is nothing to export")
    if len(leaves) > 1:
        described = "; ".join(_describe(forest, leaf) for leaf in leaves)
        forks = "; ".join(f.describe() for f in forest.forks) or "none recorded"
        raise ExportError(
            f"implicit export needs a linear history but the session has {len(leaves)} leaves: {described}. "
            f"Forks: {forks}. Use export.implicit=leaves to export every chain, or write one explicit record "
            "per branch to RELAX_OUTPUT_JSON (JSONL with name and messages)"
        )
    return Exported(None, leaves[0])


def _describe(forest: SessionForest, leaf: Node) -> str:
    last = leaf.messages[-1].content[:40] if leaf.messages else ""
    return f"node {leaf.id} (after {leaf.depth} messages, turn {_turn(forest, leaf)}, ends {last!r})"


def _turn(forest: SessionForest, node: Node) -> int:
    return sum(1 for n in forest.lineage(node) if n.kind == "response")


def explicit_exports(forest: SessionForest, records: Sequence[ExportRecord]) -> list[Exported]:
    return [Exported(r.name, explicit_node(forest, r), r) for r in records]


def explicit_node(forest: SessionForest, record: ExportRecord) -> Node:
    """The committed node a record's conversation ends on, or an ExportError saying where it diverged."""
    label = f"export record {record.name!r}"
    try:
        messages = parse_messages(record.messages)
        context = Context(canonical_tools(record.tools), canonical_template_kwargs(record.chat_template_kwargs))
    except CanonicalError as error:
        raise ExportError(f"{label}: {error.param}: {error.message}") from None
    hashes = chain_all(context, messages)
    node = forest.node_for_state(hashes[-1])
    if node is not None and node.kind != "root":
        return _with_response(forest, label, node)
    if forest.node_for_state(hashes[0]) is None:
        raise ExportError(f"{label}: its tools/chat_template_kwargs match no request of this session")
    return _diverged(forest, label, hashes, len(messages))


def _with_response(forest: SessionForest, label: str, node: Node) -> Node:
    """`node` when its lineage holds a generated turn; a context without one has nothing to train."""
    if any(n.kind == "response" for n in forest.lineage(node)):
        return node
    raise ExportError(f"{label}: its messages end before the model's first reply, so it holds no generated token "
                      "to train; end the record with the assistant message the model returned")


def _diverged(forest: SessionForest, label: str, hashes: list[bytes], count: int) -> Node:
    m = forest.longest_prefix(hashes)
    closest = forest.node_for_state(hashes[m])
    where = f"closest committed state: node {closest.id} after {m} messages" if closest else f"after {m} messages"
    if m == count:
        raise ExportError(f"{label}: it ends inside a committed request (messages[{m - 1}]); {where}")
    committed = forest.next_committed(hashes, m)
    what = "has no committed counterpart" if committed is None else f"differs from committed {committed.role} message"
    raise ExportError(f"{label}: messages[{m}] {what}; {where}")
