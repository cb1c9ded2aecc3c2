"""examples/mini_swe_agent/make_repos.py: the committed data.jsonl is what seed 0 regenerates, byte for byte, and
every row is a repository with one failing test and a fix the agent does not see."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from relax_pipeline.config import examples_root

FOLDER = examples_root() / "examples" / "mini_swe_agent"


def load_generator():  # noqa: ANN201 - the example's module
    spec = importlib.util.spec_from_file_location("make_repos", FOLDER / "make_repos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_committed_data_regenerates_byte_for_byte(tmp_path: Path) -> None:
    load_generator().write(0, tmp_path / "data.jsonl", 16)
    assert (tmp_path / "data.jsonl").read_bytes() == (FOLDER / "data.jsonl").read_bytes()


def test_rows_carry_a_repository_a_test_command_and_a_hidden_fix() -> None:
    rows = [json.loads(line) for line in (FOLDER / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len({r["solution"] for r in rows}) > 4
    for row in rows:
        repo, command = row["metadata"]["repo"], row["metadata"]["test_command"]
        test_file = command.split()[-1]
        assert command.startswith("python test_") and set(repo) == {test_file, test_file.removeprefix("test_")}
        assert test_file in row["input"] and "solution" not in row["metadata"]
        assert row["solution"].startswith(f"cat > {test_file.removeprefix('test_')} <<'EOF'")


def test_another_seed_gives_other_repositories() -> None:
    generator = load_generator()
    assert generator.make_rows(0, 8) == generator.make_rows(0, 8) != generator.make_rows(1, 8)
