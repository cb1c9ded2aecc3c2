"""Session keys: random secrets that share nothing with the session id; only a key authenticates."""

from __future__ import annotations

import string

from relax_pipeline.turn.sessions import ForestStore


def test_keys_are_random_and_unrelated_to_ids() -> None:
    store = ForestStore()
    sessions = [store.open("g0-0-abc", i, 0, "train", {}) for i in range(2000)]
    keys = {s.key for s in sessions}
    assert len(keys) == len(sessions) and not keys & {s.id for s in sessions}
    alphabet = set(string.ascii_letters + string.digits + "-_")
    for session in sessions[:200]:
        assert len(session.key) >= 35 and set(session.key) <= alphabet
        assert not any(session.id[i:i + 6] in session.key for i in range(len(session.id) - 5))
        assert store.authenticate(session.key) is session and store.authenticate(session.id) is None
    assert session.key not in repr(session)


def test_a_released_session_is_forgotten_but_its_key_still_names_it() -> None:
    from relax_pipeline.turn.sessions import Status

    store = ForestStore()
    live, ended = store.open("g", 0, 0, "train", {"messages": ["big"]}), store.open("g", 1, 0, "train", {})
    store.set_status(ended, Status.COMPLETED)
    assert not store.release(live) and store.authenticate(live.key) is live
    assert store.release(ended)
    assert store.authenticate(ended.key) is None and store.get(ended.id) is None and list(store) == [live]
    assert store.released(ended.key) == (ended.id, Status.COMPLETED) and store.released(ended.id) is None
