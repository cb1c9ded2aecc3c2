"""One session as the viewer shows it: its forest rebuilt from its exported contexts, and each context's tokens.

The dump holds no forest; it holds one row per exported context (a forked session's implicit export gives
one row per root-to-leaf chain, with `branch`). The tree is rebuilt as a trie of the contexts' messages:
contexts that share a message prefix share those nodes, and a node with two or more children is where the
session forked. The run's fork records (`session S turn N forked: why`, `view/folder.py`) are attached to
the fork node whose depth matches the record's differing message index, so the tree says where and why.
Contexts whose messages are identical end on the same leaf. Each context keeps its dump fields and gets
its tokens' text pieces (`view/tokens.py`) beside its loss mask, logprobs and weight versions.

This module does not read files; `view/app.py` hands it the rows and the fork records.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_pipeline.view.folder import ForkRecord
from relax_pipeline.view.tokens import TokenText

SNIPPET = 160
CONTEXT_FIELDS = ("name", "branch", "index", "mode", "status", "error", "reward", "advantage", "metadata", "tools",
                  "chat_template_kwargs", "state_hash", "prompt_length", "response_length", "turn_count",
                  "abort_count", "timing", "messages", "multimodal")


@dataclass
class TreeNode:
    """One message of the session's rebuilt forest (node 0 is the root above the first messages)."""

    id: int
    parent: int | None
    depth: int
    """Messages from the root: the node's message index + 1."""
    role: str = ""
    text: str = ""
    children: list[int] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)
    """Contexts (indexes into the session's rows) that end at this node."""
    forks: list[str] = field(default_factory=list)
    """Why the session forked here (from the run's fork records)."""

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "parent": self.parent, "depth": self.depth, "role": self.role, "text": self.text,
                "children": self.children, "contexts": self.contexts, "forks": self.forks}


def message_key(message: dict[str, Any]) -> str:
    """What makes two messages the same node: role, content, reasoning and tool calls."""
    return json.dumps([message.get("role"), message.get("content"), message.get("reasoning_content"),
                       message.get("tool_calls")], sort_keys=True, ensure_ascii=False, default=str)


def message_text(message: dict[str, Any], limit: int = SNIPPET) -> str:
    """A one-line snippet: text content (image parts as `[image]`), else the tool calls' names."""
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") if p.get("type") == "text" else f"[{p.get('type', 'part')}]"
                           for p in content if isinstance(p, dict))
    text = str(content or "")
    if not text and message.get("tool_calls"):
        text = "calls " + ", ".join(str((c.get("function") or {}).get("name", "?")) for c in message["tool_calls"])
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def build_tree(rows: Sequence[dict[str, Any]], forks: Sequence[ForkRecord]) -> list[TreeNode]:
    """The trie of the rows' messages with the fork records attached (see the module docstring)."""
    nodes = [TreeNode(0, None, 0)]
    index: dict[tuple[int, str], int] = {}
    for i, row in enumerate(rows):
        at = 0
        for message in row.get("messages") or ():
            key = (at, message_key(message))
            if key not in index:
                node = TreeNode(len(nodes), at, nodes[at].depth + 1, str(message.get("role", "")),
                                message_text(message))
                nodes.append(node)
                nodes[at].children.append(node.id)
                index[key] = node.id
            at = index[key]
        nodes[at].contexts.append(i)
    _attach_forks(nodes, forks)
    return nodes


def _attach_forks(nodes: list[TreeNode], forks: Sequence[ForkRecord]) -> None:
    branching = [n for n in nodes if len(n.children) > 1]
    for fork in forks:
        node = next((n for n in branching if n.depth == fork.message_index), None)
        if node is not None:
            node.forks.append(f"turn {fork.turn}: {fork.why}")


def context_view(row: dict[str, Any], text: TokenText) -> dict[str, Any]:
    """A row's fields for the session view plus its tokens' text pieces."""
    out = {key: row.get(key) for key in CONTEXT_FIELDS if key in row}
    tokens = list(row.get("tokens") or ())
    out.update(tokens=tokens, pieces=text.pieces(tokens), loss_mask=row.get("loss_mask") or [],
               rollout_logprobs=row.get("rollout_logprobs") or [], weight_versions=row.get("weight_versions") or [])
    return out


def session_view(step: str, rows: Sequence[dict[str, Any]], forks: Sequence[ForkRecord], text: TokenText
                 ) -> dict[str, Any]:
    """Everything the session page shows: ids, fork records, the tree and every context."""
    first = rows[0]
    return {"step": step, "session_id": first["session_id"], "group_id": first.get("group_id"),
            "forks": [{"turn": f.turn, "why": f.why, "message_index": f.message_index} for f in forks],
            "tree": [n.record() for n in build_tree(rows, forks)],
            "contexts": [context_view(row, text) for row in rows], "tokenizer": text.source}
