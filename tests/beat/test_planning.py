"""Planning: each job's first slot at start-up, the catch-up gap after every
instance was down, and the claim delay (jitter) kept in the agenda, never
slept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_anarchon.backends.base import State
from celery_anarchon.beat.scheduler import Scheduler

from .support import (
    Clock,
    at,
    open_backend,
    record_sent,
    run_restart,
    sent_messages,
    sent_slots,
    sqlite_app,
    states,
)


def test_start_up_never_records_old_slots_as_missed(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=3)
    before = open_backend(app, "before")
    record_sent(before, "tick", int((t0 - 3) * 1000))  # the job ran before: it has history
    before.close()
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        s.tick()
        history = s.backend.history("tick")  # type: ignore[union-attr]
        assert {r.state for r in history} == {State.SENT}
        # The slots inside max_late before start-up are sent, nothing older.
        assert sorted(r.slot_ms for r in history) == [int((t0 + i) * 1000) for i in (-3, -2, -1, 0)]
    finally:
        s.close()


def test_a_job_the_backend_never_saw_starts_at_start_up(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    """A first deploy: no slot of the last max_late before start-up is
    sent, only those at or after start-up less the 1 s grace."""
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=30)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        s.tick()
        clock.now = t0 + 2.5
        s.tick()
        history = s.backend.history("tick")  # type: ignore[union-attr]
        assert sorted(r.slot_ms for r in history) == [int((t0 + i) * 1000) for i in (0, 1, 2)]
        assert {r.state for r in history} == {State.SENT}
    finally:
        s.close()


def test_jitter_delays_the_claim_inside_the_heap(t0: float, tmp_path: Path) -> None:
    schedule = {"j": {"task": "proj.j", "schedule": 60.0, "anarchon": {"jitter": 5}}}
    app = sqlite_app(tmp_path, schedule, anarchon_max_late=10)
    slot = (int(t0) // 60 + 1) * 60  # the next whole minute
    clock = Clock(slot - 1.0)
    s = Scheduler(app, clock=clock)
    try:
        clock.now = slot
        wait = s.tick()
        assert 0 <= wait <= 5
        clock.now = slot + 5
        s.tick()
        assert [h["anarchon_slot"] for h in sent_messages(app)] == [slot * 1000]
    finally:
        s.close()


def test_a_job_more_frequent_than_the_jitter_never_falls_behind(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    # Claim delays up to 5 s on a one-second job: each slot's claim waits in
    # the heap while the job's next slots keep falling due on time.
    app = sqlite_app(tmp_path, every_second, anarchon_jitter=5, anarchon_max_late=10)
    clock = Clock(t0 - 10)
    s = Scheduler(app, clock=clock)
    try:
        for step in range(0, 7):
            clock.now = t0 + step
            s.tick()
            assert s.jobs["tick"].next_slot_ms == int((t0 + step + 1) * 1000)
        clock.now = t0 + 12
        s.tick()
        sent = sorted(h["anarchon_slot"] for h in sent_messages(app))
        window = [x for x in sent if t0 * 1000 <= x < (t0 + 7) * 1000]
        assert window == [int((t0 + i) * 1000) for i in range(7)]  # every one, none missed
    finally:
        s.close()


@pytest.mark.services
def test_catch_up_latest(url: str) -> None:
    app, s, r = run_restart(url, "latest")
    try:
        sent = sent_slots(app)
        # ten: 09:50 once (catch-up); one: 09:52 normally, nothing added.
        assert sorted(sent) == sorted([("ten-latest", at(r, -130)), ("one-latest", at(r, -10))])
        ten = states(s, "ten-latest")
        assert ten[at(r, -730)] is State.MISSED  # 09:40
        assert ten[at(r, -130)] is State.SENT  # 09:50
        one = states(s, "one-latest")
        assert [one[at(r, -730 + 60 * i)] for i in range(12)] == [State.MISSED] * 12
        assert one[at(r, -10)] is State.SENT
        assert s.jobs["ten-latest"].next_slot_ms == at(r, 470)  # 10:00, not 09:59
        # A second restart sends none of it again.
        s2 = Scheduler(app, clock=Clock(float(r)))
        s2.tick()
        assert sent_slots(app) == []
        s2.close()
    finally:
        s.close()


@pytest.mark.services
def test_catch_up_all_with_a_limit(url: str) -> None:
    app, s, r = run_restart(url, "all")
    try:
        one = [slot for job, slot in sent_slots(app) if job == "one-all"]
        # 09:47 to 09:51 in order, then 09:52.
        assert one == [at(r, -310 + 60 * i) for i in range(5)] + [at(r, -10)]
        history = states(s, "one-all")
        assert [history[at(r, -730 + 60 * i)] for i in range(7)] == [State.MISSED] * 7
    finally:
        s.close()


@pytest.mark.services
def test_catch_up_none_records_the_gap_as_missed(url: str) -> None:
    app, s, r = run_restart(url, "none")
    try:
        assert sent_slots(app) == [("one-none", at(r, -10))]
        ten = states(s, "ten-none")
        assert (ten[at(r, -730)], ten[at(r, -130)]) == (State.MISSED, State.MISSED)
    finally:
        s.close()


def test_a_round_takes_at_most_its_share_of_the_due_events_in_order(
    t0: float, tmp_path: Path
) -> None:
    """``pop_due(most=)`` takes the first due events in order and leaves the
    rest planned, so a large round does not move every due event through
    the heap again for each claim batch."""
    from celery_anarchon.beat.agenda import CLAIM, Slot

    schedule = {f"j{i}": {"task": "proj.j", "schedule": 3600.0} for i in range(5)}
    s = Scheduler(sqlite_app(tmp_path, schedule), clock=Clock(t0))
    try:
        agenda = s.agenda
        while agenda.pop_due(2**62):  # empty the planned first slots
            pass
        base = int(t0 * 1000)
        for i, name in enumerate(sorted(s.jobs)):
            agenda.push(base + i, Slot(s.jobs[name], base + i, CLAIM))
        first = agenda.pop_due(base + 10, most=2)
        assert [slot.slot_ms - base for slot in first] == [0, 1]
        assert agenda.next_due_ms() == base + 2
        rest = agenda.pop_due(base + 10, most=10)
        assert [slot.slot_ms - base for slot in rest] == [2, 3, 4]
        assert agenda.pop_due(base + 10) == []
    finally:
        s.close()
