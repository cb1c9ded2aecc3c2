"""A run does not keep what it has written: once a step's (or an eval's) rows are in the dump, the store
releases those sessions (forest, memo, prompt), so memory follows the live groups, not the run's length.
`bench/soak.py` measures the gateway's RSS under load; this checks the run wires the release in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e_rollout import compose_config

from relax_pipeline.run import run
from relax_pipeline.turn.sessions import ForestStore


def test_every_session_written_to_the_dump_is_released_from_the_store(tmp_path: Path, tiny_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    stores: list[ForestStore] = []
    released: list[str] = []
    original_open, original_release = ForestStore.open, ForestStore.release

    def open_session(self: ForestStore, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - pass-through
        if self not in stores:
            stores.append(self)
        return original_open(self, *args, **kwargs)

    def release(self: ForestStore, session) -> bool:  # noqa: ANN001 - a Session
        done = original_release(self, session)
        if done:
            released.append(session.id)
        return done

    monkeypatch.setattr(ForestStore, "open", open_session)
    monkeypatch.setattr(ForestStore, "release", release)
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {i} + 1?"}) + "\n" for i in range(2)))
    run(compose_config(tmp_path, tiny_path, "rollout.num_steps=2", "eval.interval=1",
                       f"eval.datasets=[{{name:small,path:{data}}}]"))
    written = {json.loads(line)["session_id"] for path in (tmp_path / "dump").glob("*.jsonl")
               for line in path.read_text().splitlines()}
    assert len(stores) == 1 and len(written) >= 2 * 4 + 3 * 2
    assert set(released) == written and len(released) == len(written)
    assert len(stores[0]) == 0, "no session is left in the store at the end of the run"
