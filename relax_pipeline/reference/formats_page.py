"""`docs/reference/formats.md`: the rollout dump's row fields and the replay bundle's format, from the code.

The dump's fields are read with `ast` from `stages/transfer.py`, the stage that lays rows out (the keys of
`_base`'s dict, the keywords of `row.update(...)` and the keys assigned as `row[...]`), each marked with the
row kinds that carry it (context rows from `_row`, session rows from `_failed_row`); what each field means is
`FIELDS` below, and a field the code has without an entry there (or an entry the code no longer has) fails the
generation, naming it. The outcomes are `stages/group.py`'s `OUTCOMES` with its docstring. The replay bundle is
`replay/format.py`'s constants and its `format.md` beside it, included whole.

What it does not do: read or write dumps (`tracking/dump.py`) or bundles (`replay/`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from relax_pipeline.reference.markdown import code, generated_note, prose, table
from relax_pipeline.replay import format as bundle
from relax_pipeline.stages import group

PACKAGE = Path(__file__).resolve().parents[1]
TRANSFER = PACKAGE / "stages" / "transfer.py"
ROW_MAKERS = {"_row": "context", "_failed_row": "session", "_base": "both"}
"""The functions of transfer.py that build rows, and which rows they build."""

FIELDS = {
    "rollout_id": "the step's id (`{rollout_id}` of the file name; eval rows: `eval_<name>_<steps done>`)",
    "group_id": "the prompt group the session belongs to (`RELAX_GROUP_ID`)",
    "session_id": "the session (`RELAX_SESSION_ID`; its folder under `sessions/`)",
    "index": "the session's position in its group",
    "mode": "`train` or `eval`",
    "status": "the session's lifecycle status: `completed`, `truncated`, `aborted`, `failed`, `dropped` or `filtered`",
    "outcome": "how the session ended, one of the outcomes below (every row of a session has the same one)",
    "error": "why a failed or dropped session ended (exit code and the agent's log tail), or the failure of an agent "
             "that failed after its last turn was cut; null otherwise (a filtered row too)",
    "timing": "the session's marks (epoch seconds: `created`, `running`, `exited`, ...) and `agent_s`",
    "timing.turns": "context rows: one `{queue_ms, generation_ms, total_ms}` per generated turn of the context",
    "name": "the export's name; null for an implicit export (and on session rows)",
    "branch": "the chain index of a forked session's implicit export; null otherwise",
    "reward": "the context's task outcome as exported or scored (a filtered row keeps the reward it was scored with)",
    "advantage": "the base scalar credit (after group normalization or the user's hook, before token expansion and "
                 "whitening); null on session rows",
    "metadata": "the context's export metadata (session rows: the prompt's metadata)",
    "messages": "the context's conversation (images replaced by their digest); empty on session rows",
    "tools": "the tools the context was generated with",
    "chat_template_kwargs": "the template kwargs the context was generated with",
    "state_hash": "the chained hash of the context's final state; null on session rows",
    "tokens": "prompt and response token ids (for images: the processor-expanded training ids)",
    "loss_mask": "one per response token: 1 on generated tokens, 0 on observations",
    "rollout_logprobs": "one per response token: the sampler's logprob (0.0 on observation tokens)",
    "weight_versions": "one per response token: the weight version that generated it",
    "prompt_length": "tokens before the first generated token",
    "response_length": "tokens from the first generated token on",
    "turn_count": "generated turns in the context (session rows: in the session)",
    "abort_count": "times a generation of the session was aborted and resumed (partial rollout, weight updates)",
    "multimodal": "rows with images only: `{image_grid_thw, image_tokens}`",
}
"""What each dump field means (docs/design.md §3.4)."""


def dump_fields() -> dict[str, set[str]]:
    """Every field the transfer stage writes → the row kinds (`context`, `session`) that carry it, in order."""
    tree = ast.parse(TRANSFER.read_text())
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ROW_MAKERS:
            kinds = {"context", "session"} if ROW_MAKERS[node.name] == "both" else {ROW_MAKERS[node.name]}
            for name in _fields_in(node):
                found.setdefault(name, set()).update(kinds)
    return found


def _fields_in(function: ast.FunctionDef) -> list[str]:
    names: list[str] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            names += [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            names += [k.arg for k in node.keywords if k.arg]
        elif isinstance(node, ast.Assign):
            names += [path for target in node.targets if (path := _row_key(target))]
    return names


def _row_key(target: ast.expr) -> str | None:
    """`row["a"]["b"] = ...` → `a.b`; anything else → None."""
    keys = []
    while isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
        keys.insert(0, str(target.slice.value))
        target = target.value
    return ".".join(keys) if keys and isinstance(target, ast.Name) and target.id == "row" else None


def outcomes() -> list[tuple[str, str]]:
    """(outcome, what it means) for `group.OUTCOMES`, read from the docstring under it."""
    doc = " ".join(_constant_doc(PACKAGE / "stages" / "group.py", "OUTCOMES").split())
    starts = sorted((m.start(), name) for name in group.OUTCOMES
                    for m in re.finditer(rf"(?<![\w/]){re.escape(name)}: ", doc))
    out = {}
    for (at, name), (end, _) in zip(starts, [*starts[1:], (len(doc), "")], strict=True):
        out.setdefault(name, doc[at + len(name) + 2:end].rstrip("; ."))
    return [(name, out.get(name, "")) for name in group.OUTCOMES]


def _constant_doc(path: Path, name: str) -> str:
    body = ast.parse(path.read_text()).body
    for statement, after in zip(body, body[1:], strict=False):
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(after, ast.Expr):
            return str(getattr(after.value, "value", ""))
    return ""


def _dump() -> str:
    fields = dump_fields()
    undescribed = sorted(set(fields) - set(FIELDS))
    gone = sorted(set(FIELDS) - set(fields))
    if undescribed or gone:
        raise ValueError(f"the dump's fields changed (stages/transfer.py): describe {undescribed} and remove {gone} "
                         "in relax_pipeline/reference/formats_page.py FIELDS (and docs/design.md §3.4)")
    rows = [[code(name), "yes" if "context" in kinds else "", "yes" if "session" in kinds else "", prose(FIELDS[name])]
            for name, kinds in fields.items()]
    return ("## Rollout dump\n\n" + prose(DUMP_INTRO) + "\n\n"
            + table(["field", "context rows", "session rows", "what it is"], rows)
            + "\n### Outcomes\n\n" + table(["outcome", "when"], [[code(n), prose(w)] for n, w in outcomes()]))


def _bundle() -> str:
    files = [bundle.MANIFEST, bundle.ROWS, bundle.CREDIT, bundle.BATCH, bundle.BATCH_INDEX, bundle.METRICS,
             bundle.CONFIG]
    text = (PACKAGE / "replay" / "format.md").read_text()
    missing = [name for name in [*files, *bundle.BATCH_TENSORS] if f"`{name}`" not in text]
    if missing or f"version {bundle.FORMAT_VERSION}" not in text.splitlines()[0]:
        raise ValueError(f"relax_pipeline/replay/format.md does not describe {missing or 'its format version'} "
                         f"(format.py: FORMAT_VERSION={bundle.FORMAT_VERSION}): update format.md")
    body = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text.split("\n", 1)[1], flags=re.M)
    return (f"## Replay bundle, format version {bundle.FORMAT_VERSION}\n\n"
            f"From `relax_pipeline/replay/format.md`; the reader is `relax_pipeline/replay/format.py` "
            f"(`read_bundle(folder)`), its file names {', '.join(code(f) for f in files)}.\n" + body)


DUMP_INTRO = (
    "`debug.save_rollout_data=out/r_{rollout_id}.jsonl` writes one JSON line per exported context (a context row) "
    "and one per failed, dropped or filtered session (a session row, without tokens) to each step's file, relative "
    "paths under the run's output folder. Row invariants: `len(tokens) == prompt_length + response_length`; "
    "`loss_mask`, `rollout_logprobs` and `weight_versions` have `response_length` entries. Only `completed` and "
    "`truncated` sessions yield samples. A replay bundle's `rows.jsonl` holds the same rows.")


def render() -> str:
    return "\n".join(["# Formats\n", generated_note("`stages/transfer.py`, `stages/group.py` and "
                                                    "`replay/format.py` with its `format.md`"), _dump(), _bundle()])
