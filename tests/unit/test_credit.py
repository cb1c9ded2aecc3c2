"""Credit options on hand-made groups: custom and group reward models, reward objects and their metrics,
the custom advantage function (its example's exact values, every validation error, filtering, eval mode)
and passrate. Samples are built directly; the user functions live in tests/credit_hooks.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

import credit_hooks
import pytest

from relax_pipeline.agent.session_io import AgentOutput
from relax_pipeline.canonical.form import Context as CanonicalContext
from relax_pipeline.canonical.form import Message
from relax_pipeline.credit.base import RewardError
from relax_pipeline.credit.custom_advantage import AdvantageError, CustomAdvantageCredit
from relax_pipeline.credit.records import CreditContext, CreditGroup
from relax_pipeline.credit.reward import RewardCredit
from relax_pipeline.credit.reward_model import CustomRMCredit, GroupRMCredit
from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.data.dataset import Prompt
from relax_pipeline.forest.export import Exported, ExportRecord
from relax_pipeline.forest.sample import Sample
from relax_pipeline.forest.store import Node
from relax_pipeline.stages import reward as reward_stage
from relax_pipeline.stages.group import Group
from relax_pipeline.stages.reward import Reward
from relax_pipeline.stages.transfer import Transfer
from relax_pipeline.tracking.metrics import rollout_metrics
from relax_pipeline.turn.sessions import ForestStore, Status

PAYLOAD = {"messages": [{"role": "user", "content": "What is 1 + 2?"}], "metadata": {"answer": 3}}
NODE = Node(0, None, "root", (), (), b"\x00", 0)
SAMPLE = Sample((1, 2, 3, 4), 2, (1, 1), (-0.5, -0.25), (0, 0), (Message("user", "What is 1 + 2?"),
                Message("assistant", "3")), CanonicalContext(), "00", 1, False)
Export = tuple[str | None, Any, dict[str, Any]]
"""(name, exported reward, metadata) of one exported context; name None is the implicit export."""
TWO_AGENTS: list[list[Export]] = [
    [("main", 1.0, {"outcome": 1.0}), ("searcher", None, {"usefulness": 0.5})],
    [("main", 0.0, {"outcome": -1.0}), ("searcher", None, {"usefulness": 0.25})],
]


@pytest.fixture(autouse=True)
def _reset_calls() -> None:
    credit_hooks.CALLS.clear()


class Made:
    """A hand-made group with its store and the exports the Runtime stage would have matched."""

    def __init__(self, sessions: list[list[Export]], mode: str = "train") -> None:
        self.store = ForestStore()
        self.group = Group("g0", Prompt(0, "What is 1 + 2?", {"answer": 3}), 0, mode, Path("unused"))
        self.exports: dict[str, list[Exported]] = {}
        for index, specs in enumerate(sessions):
            self._session(index, specs, mode)
        self.scored = CreditGroup(self.group.id, mode, len(self.group.sessions),
                                  [self._context(i, s, e) for i, s in enumerate(self.group.sessions)
                                   for e in self.exports[s.id]])

    def _context(self, slot: int, session: Any, exported: Exported) -> CreditContext:
        output = self.group.outputs[session.id]
        record = exported.record
        metadata = record.metadata if record is not None else output.metadata
        return CreditContext(slot, session.id, exported.name, SAMPLE, metadata, session.prompt,
                             _raw(self.group, session.id, exported))

    def _session(self, index: int, specs: list[Export], mode: str) -> None:
        session = self.store.open(self.group.id, index, 0, mode, dict(PAYLOAD))
        self.group.sessions.append(session)
        records = [ExportRecord(n, [], None, None, meta, r) for n, r, meta in specs if n is not None]
        implicit = [(r, meta) for n, r, meta in specs if n is None]
        reward, metadata = implicit[0] if implicit else (None, {})
        self.group.outputs[session.id] = AgentOutput(bool(implicit), tuple(records), reward, metadata)
        self.exports[session.id] = [Exported(n, NODE, records.pop(0) if n is not None else None) for n, _, _ in specs]

    def score(self, credit: Any) -> list[tuple[float | None, float | None]]:
        asyncio.run(credit.score(self.scored))
        return [(c.reward, c.advantage) for c in self.scored.contexts]

    def stage(self, credit: Any, monkeypatch: pytest.MonkeyPatch, missing: list[str] | None = None
              ) -> list[dict[str, Any]]:
        """Reward then Transfer, as Pipeline.score_group runs them; the dump rows. `missing`: what the run lacks
        for several contexts per session (None: what the credit alone implies)."""
        monkeypatch.setattr(reward_stage, "build_sample", lambda forest, node, shared=frozenset(): SAMPLE)
        asyncio.run(Reward(self.store, credit, missing).run(self.group, self.exports))
        return Transfer(self.store).run(self.group)


def _raw(group: Group, session_id: str, exported: Exported) -> Any:
    return exported.record.reward if exported.record is not None else group.outputs[session_id].reward


# ---- credit=reward keeps its behaviour -------------------------------------------------------------------


def test_reward_credit_reads_exports_and_centres_by_group() -> None:
    made = Made([[(None, 1.0, {})], [(None, 0.0, {})]])
    scored = made.score(RewardCredit(CreditSettings(normalize_std=False)))
    assert scored == [(1.0, 0.5), (0.0, -0.5)]


def test_a_train_context_without_a_reward_fails_its_session_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = Made([[(None, 1.0, {})], [(None, None, {})]]).stage(RewardCredit(CreditSettings()), monkeypatch)
    assert [r["status"] for r in rows] == ["dropped", "failed"]
    assert "the implicit context has no reward" in rows[1]["error"] and "credit.rm_path" in rows[1]["error"]


def test_a_reward_model_returning_null_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    credit = CustomRMCredit(CreditSettings(rm_path="credit_hooks.rm_none"))
    rows = Made([[("main", None, {})]]).stage(credit, monkeypatch)
    assert rows[0]["status"] == "failed"
    assert "context 'main' has no reward: credit.rm_path='credit_hooks.rm_none' returned null" in rows[0]["error"]


def test_eval_contexts_without_a_reward_stay_unscored() -> None:
    assert Made([[(None, None, {})], [(None, 1.0, {})]], mode="eval").score(RewardCredit(CreditSettings())) == [
        (None, None), (1.0, None)]


def test_reward_credit_refuses_paths_it_does_not_use() -> None:
    with pytest.raises(ValueError, match="credit.rm_path='credit_hooks.rm_sync' is not used by credit=reward"):
        RewardCredit(CreditSettings(rm_path="credit_hooks.rm_sync"))


# ---- custom and group reward models ----------------------------------------------------------------------


@pytest.mark.parametrize("path, value", [("credit_hooks.rm_sync", 0.5), ("credit_hooks.rm_async", 0.25)])
def test_custom_rm_is_called_only_where_no_reward_was_exported(path: str, value: float) -> None:
    made = Made([[("main", 1.0, {"k": 1}), ("searcher", None, {"k": 2})], [(None, None, {"k": 3})]])
    scored = made.score(CustomRMCredit(CreditSettings(rm_path=path, estimator="reinforce_plus_plus")))
    assert scored == [(1.0, 1.0), (value, value), (value, value)]
    assert sorted((c["name"] or "", c["metadata"]["k"]) for c in credit_hooks.CALLS) == [("", 3), ("searcher", 2)]
    sample = credit_hooks.CALLS[0]
    assert sample["prompt"] == PAYLOAD and sample["messages"][-1] == {"role": "assistant", "content": "3"}
    assert set(sample) == {"name", "messages", "metadata", "prompt", "reward"}


@pytest.mark.parametrize(
    "path, fragment",
    [("nowhere_at_all.f", "cannot import module 'nowhere_at_all'"), ("credit_hooks.nope", "has no function 'nope'"),
     ("justaname", "must be 'module.function'")],
)
def test_rm_path_errors_name_the_key(path: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=f"credit.rm_path={path!r}.*{fragment}"):
        CustomRMCredit(CreditSettings(rm_path=path))


def test_custom_rm_needs_rm_path() -> None:
    with pytest.raises(ValueError, match="credit=custom_rm needs credit.rm_path"):
        CustomRMCredit(CreditSettings())


def test_group_rm_sees_the_whole_group_in_order_and_exported_rewards_win() -> None:
    made = Made([[("main", None, {"i": 0}), ("searcher", 9.0, {"i": 1})], [("main", None, {"i": 2})]])
    scored = made.score(GroupRMCredit(CreditSettings(rm_path="credit_hooks.group_rm", estimator="reinforce_plus_plus")))
    (samples,) = credit_hooks.CALLS
    assert [(s["name"], s["metadata"]["i"], s["reward"]) for s in samples] == [
        ("main", 0, None), ("searcher", 1, 9.0), ("main", 2, None)]
    assert scored == [(0.0, 0.0), (9.0, 9.0), (2.0, 2.0)]


def test_group_rm_result_of_the_wrong_length_names_the_key() -> None:
    made = Made([[(None, None, {})], [(None, None, {})]])
    with pytest.raises(ValueError, match=r"credit.rm_path='credit_hooks.group_rm_short' returned 1 rewards for 2"):
        made.score(GroupRMCredit(CreditSettings(rm_path="credit_hooks.group_rm_short")))


def test_group_rm_then_the_advantage_hook() -> None:
    """The seed's group RM plus custom advantage: the RM fills the rewards, the hook gives the base credit."""
    made = Made([[("main", None, {"outcome": 1.0}), ("searcher_0", None, {"usefulness": 0.5})],
                 [("main", None, {"outcome": 0.0})]])
    credit = GroupRMCredit(CreditSettings(rm_path="credit_hooks.group_rm",
                                          advantage_path="credit_hooks.advantage_recording"))
    assert made.score(credit) == [(0.0, 1.0), (1.0, 0.5), (2.0, 0.0)]
    assert credit_hooks.CALLS[-1] == [{"main": {"outcome": 1.0}, "searcher_0": {"usefulness": 0.5}},
                                      {"main": {"outcome": 0.0}}]


def test_custom_rm_still_refuses_an_advantage_path() -> None:
    with pytest.raises(ValueError, match="credit.advantage_path='credit_hooks.advantage_recording' is not used by "
                                         "credit=custom_rm"):
        CustomRMCredit(CreditSettings(rm_path="credit_hooks.rm_sync",
                                      advantage_path="credit_hooks.advantage_recording"))


def test_reward_objects_from_the_rm_give_the_primary_value_and_field_metrics(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    made = Made([[("main", None, {})], [("searcher", None, {})]])
    rows = made.stage(CustomRMCredit(CreditSettings(rm_path="credit_hooks.rm_object", reward_key="score")), monkeypatch)
    assert [r["reward"] for r in rows] == [1.0, 1.0]
    metrics = rollout_metrics(rows, [made.group])
    assert metrics["rollout/raw_reward"] == 1.0
    assert (metrics["rollout/format/mean"], metrics["rollout/format/max"], metrics["rollout/format/min"]) == (
        1.0, 1.5, 0.5)
    assert metrics["rollout/score/median"] == 1.0


def test_a_bad_rm_value_fails_its_session_and_drops_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Made([[(None, 1.0, {})], [(None, None, {})]])
    rows = made.stage(CustomRMCredit(CreditSettings(rm_path="credit_hooks.rm_bad_value")), monkeypatch)
    assert [r["status"] for r in rows] == ["dropped", "failed"]
    assert "reward must be a number, an object or null, got str" in rows[1]["error"]


def test_reward_error_carries_the_session() -> None:
    made = Made([[(None, "x", {})]])
    with pytest.raises(RewardError) as caught:
        made.score(RewardCredit(CreditSettings()))
    assert caught.value.session_id == made.group.sessions[0].id


# ---- custom advantage --------------------------------------------------------------------------------------

EXAMPLE = "relax_pipeline.credit.examples.outcome_times_usefulness"


def test_custom_advantage_example_main_gets_outcome_searcher_outcome_times_usefulness() -> None:
    made = Made(TWO_AGENTS)
    scored = made.score(CustomAdvantageCredit(CreditSettings(advantage_path=EXAMPLE)))
    assert scored == [(1.0, 1.0), (None, 0.5), (0.0, -1.0), (None, -0.25)]


def test_custom_advantage_sees_one_mapping_per_session_name_to_final_metadata() -> None:
    made = Made(TWO_AGENTS)
    made.score(CustomAdvantageCredit(CreditSettings(advantage_path="credit_hooks.advantage_none")))
    assert credit_hooks.CALLS == [[{"main": {"outcome": 1.0}, "searcher": {"usefulness": 0.5}},
                                   {"main": {"outcome": -1.0}, "searcher": {"usefulness": 0.25}}]]


@pytest.mark.parametrize(
    "hook, fragment",
    [
        ("advantage_short", "returned 1 mappings for 2 sessions"),
        ("advantage_missing", "slot 1 name 'searcher' is missing"),
        ("advantage_nan", "slot 1 name 'searcher' must be finite, got nan"),
        ("advantage_text", "slot 1 name 'searcher' must be a number, got str"),
        ("advantage_bool", "slot 1 name 'searcher' must be a number, got bool"),
        ("advantage_extra", "slot 1 name 'critic' was not exported"),
    ],
)
def test_custom_advantage_results_are_validated_naming_slot_and_name(hook: str, fragment: str) -> None:
    made = Made(TWO_AGENTS)
    with pytest.raises(AdvantageError, match=f"credit.advantage_path='credit_hooks.{hook}'.*{fragment}"):
        made.score(CustomAdvantageCredit(CreditSettings(advantage_path=f"credit_hooks.{hook}")))


def test_none_filters_the_group(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    made = Made(TWO_AGENTS)
    with caplog.at_level(logging.INFO):
        credit = CustomAdvantageCredit(CreditSettings(advantage_path="credit_hooks.advantage_none"))
        rows = made.stage(credit, monkeypatch)
    assert made.group.dropped is None and made.group.filtered is not None and made.group.excluded
    assert [(r["status"], r["index"], r["tokens"]) for r in rows] == [("filtered", 0, []), ("filtered", 1, [])]
    assert all(r["error"] is None for r in rows), "docs/design.md §3.4: error is for failed/dropped rows only"
    assert "group g0 filtered: credit.advantage_path returned None" in caplog.text
    assert [s.status for s in made.group.sessions] == [Status.FILTERED, Status.FILTERED]
    metrics = rollout_metrics(rows, [made.group])
    assert (metrics["rollout/filtered_groups"], metrics["rollout/dropped_groups"]) == (1.0, 0.0)


def test_eval_groups_never_call_the_advantage_function() -> None:
    made = Made([[(None, 1.0, {})], [(None, 0.0, {})]], mode="eval")
    credit = CustomAdvantageCredit(CreditSettings(advantage_path="credit_hooks.advantage_raises", normalize_std=False))
    scored = made.score(credit)
    assert scored == [(1.0, 0.5), (0.0, -0.5)]


def test_implicit_exports_are_keyed_none() -> None:
    made = Made([[(None, None, {"outcome": 0.5})]])
    assert made.score(CustomAdvantageCredit(CreditSettings(advantage_path=EXAMPLE))) == [(None, 0.5)]


# ---- several contexts per session at run time ------------------------------------------------------------


@pytest.mark.parametrize(
    "credit, missing, keys",
    [
        (RewardCredit(CreditSettings()), None, "need credit=custom_advantage (declare"),
        (CustomAdvantageCredit(CreditSettings(advantage_path=EXAMPLE)), ["trainer.use_dynamic_batch_size=true"],
         "need trainer.use_dynamic_batch_size=true (declare"),
    ],
)
def test_several_contexts_without_what_they_need_fail_the_session_naming_the_keys(
        credit: Any, missing: list[str] | None, keys: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = Made(TWO_AGENTS)
    rows = made.stage(credit, monkeypatch, missing)
    assert [(r["status"], r["index"]) for r in rows] == [("failed", 0), ("dropped", 1)]
    assert "exported 2 contexts ['main', 'searcher']" in rows[0]["error"] and keys in rows[0]["error"]
    assert made.group.dropped and not credit_hooks.CALLS


def test_several_contexts_are_fine_in_eval_and_under_custom_advantage(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = Made(TWO_AGENTS, mode="eval").stage(RewardCredit(CreditSettings()), monkeypatch)
    assert [r["status"] for r in rows] == ["completed"] * 4
    rows = Made(TWO_AGENTS).stage(CustomAdvantageCredit(CreditSettings(advantage_path=EXAMPLE)), monkeypatch, [])
    assert [r["advantage"] for r in rows] == [1.0, 0.5, -1.0, -0.25]


# ---- metrics ----------------------------------------------------------------------------------------------


def test_passrate_counts_sessions_not_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Made(TWO_AGENTS + [[("main", 1, {"outcome": 0.0}), ("searcher", None, {})]])
    rows = made.stage(CustomAdvantageCredit(CreditSettings(advantage_path=EXAMPLE, log_passrate=True)), monkeypatch)
    metrics = rollout_metrics(rows, [made.group], log_passrate=True)
    assert math.isclose(metrics["passrate"], 2 / 3)
    assert metrics["rollout/raw_reward"] == pytest.approx(2 / 3)
    assert "passrate" not in rollout_metrics(rows, [made.group])


def test_group_rm_credits_several_contexts_only_with_an_advantage_function() -> None:
    rm = CreditSettings(rm_path="credit_hooks.group_rm")
    hooked = CreditSettings(rm_path="credit_hooks.group_rm", advantage_path="credit_hooks.advantage_recording")
    assert not GroupRMCredit.credits_several(rm) and GroupRMCredit.credits_several(hooked)
    assert not GroupRMCredit(rm).several_contexts and GroupRMCredit(hooked).several_contexts
    assert GroupRMCredit(rm).needs_reward and not GroupRMCredit(hooked).needs_reward
