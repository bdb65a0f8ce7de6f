"""The campaign's verdict on misses (``tests.faults.campaign.judge``), on
outcomes built by hand: no service needed."""

from __future__ import annotations

from collections import Counter

from celery_anarchon.backends.base import RunRecord, State

from .campaign import judge
from .harness import IN_DOUBT, Outcome

SLOTS = [("job", 1000), ("job", 2000)]


def outcome_with(second: RunRecord | None) -> Outcome:
    """Two due slots; the first published and run, the second not, with
    ``second`` as its only record (or none)."""
    history = [RunRecord("job", 1000, State.SUCCEEDED, token=1)]
    if second is not None:
        history.insert(0, second)
    return Outcome(
        due=list(SLOTS),
        published=Counter({SLOTS[0]: 1}),
        executed=Counter({SLOTS[0]: 1}),
        history={"job": history},
        window=(0.0, 3.0),
    )


def test_a_miss_recorded_lost_in_doubt_is_allowed_where_misses_are_not() -> None:
    lost = RunRecord(
        "job", 2000, State.LOST, token=1, error=f"publish failed after it {IN_DOUBT}: reset"
    )
    outcome = outcome_with(lost)
    assert outcome.counts()["missed_in_doubt"] == 1
    assert judge(outcome, misses_allowed=False, backend="redis") == []


def test_a_miss_recorded_lost_for_another_reason_still_fails_where_misses_are_not() -> None:
    lost = RunRecord("job", 2000, State.LOST, token=1, error="send failed: refused")
    outcome = outcome_with(lost)
    assert outcome.counts()["missed_in_doubt"] == 0
    assert judge(outcome, misses_allowed=False, backend="redis") == ["missed"]
    assert judge(outcome, misses_allowed=True, backend="redis") == []


def test_an_unrecorded_miss_fails_even_where_misses_are_allowed() -> None:
    outcome = outcome_with(None)
    assert judge(outcome, misses_allowed=True, backend="redis") == ["miss-unrecorded"]
