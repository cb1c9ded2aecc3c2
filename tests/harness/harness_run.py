"""Runs one real harness through `run(cfg)` with `engine=scripted`, and checks what the run recorded.

`run_harness` composes `job=rollout agent=<preset> engine=scripted` on the toy dataset (one group of `samples` sessions;
the runners export no reward, so the exact-match reward model scores them), with a context limit large enough for the
coding agents' system prompts, and returns the dump rows, the run's metrics and its access lines. `check_run` asserts
the tier's contract: at least one trained sample, no failed or dropped session, no gateway 4xx/5xx, no fork, and
token-exact turn boundaries (`len(tokens) == prompt_length + response_length`, loss 1 exactly on the tokens the engine
generated, `turn_count` equal to the model calls the session made). `skip_unless` skips a test whose harness package is
missing, naming the extra that installs it."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams
from relax_pipeline.run import run
from relax_pipeline.testing.script_engine import ScriptEngine

ACCESS = re.compile(r"relax_pipeline\.gateway\.access.*?api=(\S+) session=(\S+) status=(\d+) stream=(\S+)(.*)")
FAILED = ("failed", "dropped")


def installed(module: str) -> bool:
    """Whether `module` is a real installed module: a directory on `sys.path` that merely shares its name (pytest puts
    `tests/` there, and `tests/agents` would pass for openai-agents' `agents`) is a namespace package with no origin."""
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.origin not in (None, "namespace")


def skip_unless(*modules: str) -> None:
    """Skip the calling test when a harness package is not installed (they come with the `harness` extra); where
    `RELAX_REQUIRE_EXTRAS` names `harness` (CI), tests/conftest.py turns that skip into a failure."""
    missing = [m for m in modules if not installed(m)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install -e '.[harness]'")


class RecordingScriptEngine(ScriptEngine):
    """The scripted engine, remembering (prompt ids, output ids) of every call; the last instance is kept."""

    last: RecordingScriptEngine | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[int], list[int]]] = []
        RecordingScriptEngine.last = self

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid, media)
        self.calls.append((list(input_ids), list(result.output_ids)))
        return result


@dataclass(frozen=True)
class Access:
    """One access line of run.log: which API a model request used, its session, status and stream flag."""

    api: str
    session: str
    status: int
    stream: bool
    rest: str


@dataclass
class HarnessRun:
    """What one run left: its dump rows, metrics, access lines, engine calls and log text."""

    rows: list[dict]
    metrics: dict[str, float]
    access: list[Access]
    calls: list[tuple[list[int], list[int]]]
    log: str

    def model_calls(self, session: str) -> int:
        return sum(a.session == session and a.status == 200 for a in self.access)


def write_script(folder: Path, lines: list[dict]) -> Path:
    path = folder / "script.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_harness(tmp_path: Path, tiny_path: Path, agent: str, script: list[dict], *overrides: str,
                samples: int = 2) -> HarnessRun:
    """One rollout step of `agent=<agent>` driven by `script`, offline; never raises for a failed session."""
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=rollout", f"agent={agent}", "dataset=toy", "engine=scripted",
            "credit=custom_rm", "credit.rm_path=relax_pipeline.credit.examples.exact_match",
            f"engine.script={write_script(tmp_path, script)}", f"engine._target_={__name__}.RecordingScriptEngine",
            "rollout.num_steps=1", "rollout.batch_size=1", f"rollout.n_samples_per_prompt={samples}",
            "rollout.max_response_len=512", "rollout.max_context_len=262144", f"output_dir={tmp_path}",
            f"model.cache_dir={tiny_path.parent}", f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl",
            *overrides,
        ]))
    metrics = run(cfg)
    log = (tmp_path / "run.log").read_text()
    dump = tmp_path / "dump" / "r_0.jsonl"
    rows = [json.loads(line) for line in dump.read_text().splitlines()] if dump.is_file() else []
    access = [Access(m[1], m[2], int(m[3]), m[4] == "true", m[5]) for m in ACCESS.finditer(log)]
    engine = RecordingScriptEngine.last
    return HarnessRun(rows, metrics, access, engine.calls if engine else [], log)


def check_run(result: HarnessRun, tools_at_least: int = 2, linear: bool = True) -> list[dict]:
    """The tier's contract (module docstring); returns the trained rows. `linear=False` accepts forked sessions
    (each chain its own row) and checks that every model call is trained in exactly one chain instead."""
    errors = [a for a in result.access if a.status >= 400]
    assert not errors, f"gateway answered errors: {[(a.api, a.status, a.rest.strip()) for a in errors]}"
    lost = [(r["status"], r["error"]) for r in result.rows if r["status"] in FAILED]
    assert not lost, f"lost sessions: {lost}"
    if linear:
        assert result.metrics.get("rollout/fork_count", 0.0) == 0.0, _forks(result.log)
    trained = [r for r in result.rows if r["status"] in ("completed", "truncated") and 1 in r["loss_mask"]]
    assert trained, f"no trained sample in {[r['status'] for r in result.rows]}"
    turns: Counter[str] = Counter()
    for row in trained:
        check_boundaries(row, result.calls)
        turns[row["session_id"]] += row["turn_count"]
    for session, count in turns.items():
        assert count == result.model_calls(session), f"{session}: one trained turn per model call"
        assert count > tools_at_least, "the script's tool calls and a final answer"
    return trained


def check_boundaries(row: dict, calls: list[tuple[list[int], list[int]]]) -> None:
    """Token-exact turns: loss is 1 exactly on the spans the engine generated inside this row's tokens."""
    tokens, prompt_length = row["tokens"], row["prompt_length"]
    n = row["response_length"]
    assert len(tokens) == prompt_length + n
    assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == len(row["weight_versions"]) == n
    spans = sorted({(len(p), len(p) + len(o)) for p, o in calls if tokens[: len(p) + len(o)] == p + o})
    assert spans and spans[0][0] == prompt_length, "the first generated token follows the prompt"
    expected = [0] * len(tokens)
    for start, end in spans:
        expected[start:end] = [1] * (end - start)
    assert expected[prompt_length:] == row["loss_mask"], "loss 1 exactly on generated tokens"
    assert len(spans) == row["turn_count"], "each generated span is one turn"
    for mask, logprob in zip(row["loss_mask"], row["rollout_logprobs"], strict=True):
        assert (logprob == 0.0) if mask == 0 else (logprob < 0.0)


def xfail_on_gateway_error(result: HarnessRun, error: str, defect: str) -> None:
    """Mark the test xfailed when a known gateway defect (`error` in a 4xx/5xx access line) stopped the harness;
    any other failure still fails, and once the defect is fixed the test runs its checks and passes."""
    if any(a.status >= 400 and error in a.rest for a in result.access):
        pytest.xfail(f"gateway defect: {defect}")


def apis(result: HarnessRun) -> Counter[tuple[str, bool]]:
    """How many model requests used each (api, stream) pair."""
    return Counter((a.api, a.stream) for a in result.access)


def _forks(log: str) -> str:
    return "sessions forked: " + "; ".join(line for line in log.splitlines() if "forked" in line)[:2000]
