"""User functions for tests/test_credit.py, named by `credit.rm_path` / `credit.advantage_path` as `credit_hooks.f`.

Every call is appended to `CALLS` (reset by the tests) so a test can see what each function was given.
"""

from __future__ import annotations

from typing import Any

CALLS: list[Any] = []


def rm_sync(sample: dict[str, Any]) -> float:
    CALLS.append(sample)
    return 0.5


async def rm_async(sample: dict[str, Any]) -> float:
    CALLS.append(sample)
    return 0.25


def rm_object(sample: dict[str, Any]) -> dict[str, float]:
    CALLS.append(sample)
    return {"score": 1.0, "format": 0.5 if sample["name"] == "main" else 1.5}


def rm_bad_value(sample: dict[str, Any]) -> str:
    return "great"


def group_rm(samples: list[dict[str, Any]]) -> list[float]:
    CALLS.append(samples)
    return [float(i) for i in range(len(samples))]


def group_rm_short(samples: list[dict[str, Any]]) -> list[float]:
    return [1.0]


def advantage_none(metadata_by_slot: list[dict[str | None, dict]]) -> None:
    CALLS.append(metadata_by_slot)
    return None


def advantage_raises(metadata_by_slot: list[dict[str | None, dict]]) -> None:
    raise AssertionError("the advantage function must not be called for eval groups")


def _ok() -> list[dict[str | None, Any]]:
    return [{"main": 1.0, "searcher": 0.5}, {"main": -1.0, "searcher": -0.25}]


def advantage_short(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return _ok()[:1]


def advantage_missing(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return [_ok()[0], {"main": 1.0}]


def advantage_nan(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return [_ok()[0], {"main": 1.0, "searcher": float("nan")}]


def advantage_text(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return [_ok()[0], {"main": 1.0, "searcher": "0.5"}]


def advantage_bool(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return [_ok()[0], {"main": 1.0, "searcher": True}]


def advantage_extra(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, Any]]:
    return [_ok()[0], {"main": 1.0, "searcher": 0.0, "critic": 0.0}]


SEEN: set[str] = set()


def reject_first_sight_of_flaky(samples: list[dict]) -> bool:
    """`credit.filter_path` for the over-sampling test: a prompt marked `flaky` is rejected the first time."""
    prompt = samples[0]["prompt"]
    key = prompt["messages"][0]["content"]
    if prompt.get("metadata", {}).get("flaky") and key not in SEEN:
        SEEN.add(key)
        return False
    return True


def advantage_recording(metadata_by_slot: list[dict[str | None, dict]]) -> list[dict[str | None, float]] | None:
    """The seed's example (`outcome_times_usefulness`), recording every call so a test can see which groups
    reached it (eval groups never may)."""
    from relax_pipeline.credit.examples import outcome_times_usefulness

    CALLS.append(metadata_by_slot)
    return outcome_times_usefulness(metadata_by_slot)


def reject_all(samples: list[dict]) -> bool:
    """`credit.filter_path`: keep no group (every start of a step is filtered and replaced)."""
    return False


def rm_none(sample: dict[str, Any]) -> None:
    """A reward model that scores nothing."""
    return None


def metrics_of_rows(rows: list[dict[str, Any]]) -> dict[str, float]:
    """`credit.metrics_path`: how many rows and how many completed; rows are copies, so the edit is harmless."""
    CALLS.append(rows)
    metrics = {"rows": len(rows), "completed": sum(r["status"] == "completed" for r in rows)}
    rows[0]["status"] = "edited"
    return metrics


async def metrics_async(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {"rows": float(len(rows))}


def metrics_not_a_dict(rows: list[dict[str, Any]]) -> list[float]:
    return [1.0]


def metrics_nan(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {"bad": float("nan")}


def metrics_raises(rows: list[dict[str, Any]]) -> dict[str, float]:
    raise RuntimeError("boom")
