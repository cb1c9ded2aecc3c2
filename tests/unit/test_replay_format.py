"""The replay bundle's format pieces without a run: the reader stands alone, the batch round-trips bit for bit,
another format version is refused naming both, and the command line's credit edits are told from defaults."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from relax_pipeline.forest.sample import Sample
from relax_pipeline.replay import format as fmt
from relax_pipeline.replay.credit import same
from relax_pipeline.replay.job import credit_overrides
from relax_pipeline.replay.loss import verdict
from relax_pipeline.replay.recorder import write_batch


def test_the_reader_imports_only_json_and_safetensors() -> None:
    tree = ast.parse(Path(fmt.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert modules <= {"__future__", "json", "pathlib", "typing", "safetensors.numpy"}, modules


def test_the_batch_round_trips_bit_for_bit(tmp_path: Path) -> None:
    rows = [Sample((1, 2, 3, 4), 2, (1, 0), (-0.1234567890123, 0.0), (3, 3), advantage=1 / 3),
            Sample((5, 6, 7), 1, (1, 1), (-2.5e-8, -7.0), advantage=-0.7071067811865476)]
    write_batch(tmp_path, rows, {id(rows[0]): {"group_id": "g", "slot": 0, "session_id": "s", "name": None,
                                               "branch": None}})
    back = fmt.read_batch(tmp_path)
    assert [r["tokens"] for r in back] == [[1, 2, 3, 4], [5, 6, 7]]
    assert [r["rollout_logprobs"] for r in back] == [[-0.1234567890123, 0.0], [-2.5e-8, -7.0]]
    assert [r["advantage"] for r in back] == [1 / 3, -0.7071067811865476]
    assert [r["weight_versions"] for r in back] == [[3, 3], [-1, -1]], "no versions recorded: -1 each"
    assert back[0]["group_id"] == "g" and "group_id" not in back[1]


def test_another_format_version_is_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / fmt.MANIFEST).write_text(json.dumps({"format_version": 0, "code_version": {"package": "0.0.1"}}))
    with pytest.raises(fmt.BundleVersionError, match=r"format_version=0; .* reads format_version=1 only.*0\.0\.1"):
        fmt.read_manifest(tmp_path)
    with pytest.raises(FileNotFoundError, match="replay.bundle"):
        fmt.read_manifest(tmp_path / "missing")


def test_credit_edits_are_the_keys_that_differ_from_the_defaults() -> None:
    node = {"_target_": "relax_pipeline.credit.reward.RewardCredit", "estimator": "grpo", "advantage_path": "m.f",
            "kl_coef": 0.0}
    assert credit_overrides(node) == {"advantage_path": "m.f"}


def test_verdicts_name_the_tolerance() -> None:
    assert verdict(0.5, 0.5, 1e-4).startswith("identical (bit-exact)")
    assert verdict(1.0, 1.00001, 1e-4).startswith("within the tolerance rtol=0.0001")
    assert verdict(1.0, 1.1, 1e-4).startswith("DIFFERS beyond the tolerance rtol=0.0001")
    assert same(float("nan"), float("nan")) and not same(None, 0.0)
