"""The package's floors, top to bottom: the one list every import of the package points down.

A unit is a package below `relax_pipeline` (`engine`, `train`, ...) or a top-level module (`run`, `config`,
`loop`, `__main__`, this one). `FLOORS` orders them: a unit may import any unit on a floor below its own, never one
above, and one on its own floor only where `SIDEWAYS` lists that pair. `relax_pipeline.testing` (the test
doubles) stands outside the floors: it may import anything and no other unit imports it.

`tests/unit/test_import_contract.py` checks every import of the package against this list (imports under
`TYPE_CHECKING` and inside functions count), and `docs/layout.md` shows it as `render()` writes it
(`tests/unit/test_layout_doc.py` fails when the page's copy differs). A lower unit that needs to call up takes a
`Protocol` it declares itself, or a callback.

Nothing at run time imports this module.
"""

from __future__ import annotations

from pathlib import Path

TESTING = "testing"
"""The test doubles: may import any unit, imported by none."""

FLOORS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("reference",), "the generated reference pages (docs/reference/) and the docs' runnable commands"),
    (("__main__",), "`python -m relax_pipeline [overrides]`: `@hydra.main` and a call to `run(cfg)`"),
    (("run",), "`run(cfg)`: the composed config as records, the job's recipe run, its metrics returned"),
    (("recipes",), "one recipe per job (train, rollout, eval, check, replay, view) and the parts they build"),
    (("config",), "the typed config schema (the nodes' records composed, in ConfigStore) and cross-key validation"),
    (("certify", "view"), "`job=check`'s certificate; the run viewer (`job=view`)"),
    (("loop",), "the step loop: rollout → train → weight sync → eval → checkpoint"),
    (("replay",), "replay bundles and `job=replay`: a step's credit and loss re-run on a CPU"),
    (("scheduling",), "runtime modes (`runtime=`): when groups start, how many are resident, when a step closes"),
    (("stages",), "Prepare, Runtime, Reward, Transfer; the pipeline of one group; eval; capacity"),
    (("gateway",), "HTTP only: routes, auth, SSE, the uvicorn server, the OpenAPI document"),
    (("protocol",), "wire ↔ turn records, one front-end per model API"),
    (("turn",), "the model turn as one service, the session registry, group leases"),
    (("train",), "the Trainer protocol, torch and DeepSpeed backends, losses, batching, ranks"),
    (("credit",), "rewards, reward models, the advantage hook, the estimators and their names"),
    (("forest",), "the SessionForest, export matching, lineage → sample"),
    (("engine",), "generation: the Engine protocol, the embedded HF engine (`hf/`), the SGLang client (`sglang/`)"),
    (("agent",), "where and how agent processes run: launcher, executors, services, sandbox, session files"),
    (("data", "models", "tracking"), "datasets and media; built-in models; logs, metrics, dump, trackers"),
    (("infra",), "Ray runtime, process helpers (free ports, child-process watch, death signals)"),
    (("chat",), "the model's text: chat templates, the codec, words, tool-call and reasoning parsers"),
    (("canonical",), "the canonical conversation: records, validation, chained hashes"),
    (("floors",), "this list"),
)
"""Each floor's units and what the floor is for, top to bottom."""

SIDEWAYS: frozenset[tuple[str, str]] = frozenset()
"""(importing unit, imported unit) pairs allowed within one floor; none today."""


def floor_of() -> dict[str, int]:
    """Unit → its floor's index (0 is the top)."""
    return {unit: index for index, (units, _) in enumerate(FLOORS) for unit in units}


def allowed(here: str, there: str) -> bool:
    """Whether unit `here` may import unit `there`: a lower floor, a listed sideways pair, or the test doubles
    importing anything. Unknown units are never allowed."""
    floors = floor_of()
    if here == TESTING:
        return True
    if here not in floors or there not in floors:
        return False
    return floors[there] > floors[here] or (here, there) in SIDEWAYS


def render() -> str:
    """The floors as `docs/layout.md` shows them: one line a floor, its units and what it is for."""
    root = Path(__file__).parent
    lines = []
    for units, about in FLOORS:
        names = " ".join(f"{u}.py" if (root / f"{u}.py").is_file() else f"{u}/" for u in units)
        lines.append(f"{names:<26}{about}")
    return "\n".join(lines)
