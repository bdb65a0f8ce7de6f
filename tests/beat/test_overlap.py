"""Overlap: ``overlap='skip'`` skips a slot while the previous run is in
flight, reads each deferred slot's history once, and applies to catch-up
slots too."""

from __future__ import annotations

import time

import pytest

from celery_anarchon.backends.base import ClaimRequest, State
from celery_anarchon.beat.scheduler import Scheduler

from ..conftest import REDIS_URL, require_service
from .support import (
    Clock,
    delay_sends,
    jobs_app,
    make_app,
    next_slot,
    open_backend,
    record_finished,
    sent_slots,
    spy,
    states,
)


@pytest.mark.services
def test_catch_up_all_respects_overlap_skip() -> None:
    """``catch_up='all'`` used to claim every caught-up slot in one batch,
    past the overlap check: five runs of a job that must not overlap went
    out at once. Now the oldest goes out and the others, while it is in
    flight, are recorded skipped (the same for the first regular slot)."""
    require_service("redis")
    restart = int(time.time())
    schedule = {
        "once": {
            "task": "t.once",
            "schedule": 60.0,
            "anarchon": {
                "anchor": restart - 10,
                "catch_up": "all",
                "catch_up_limit": 5,
                "overlap": "skip",
            },
        }
    }
    app = make_app(REDIS_URL, schedule)
    before = open_backend(app, "before")
    record_finished(before, "once", (restart - 790) * 1000, State.SUCCEEDED)
    before.close()
    s = Scheduler(app, clock=Clock(float(restart)))
    try:
        s.tick()
        caught_up = [(restart - 310 + 60 * i) * 1000 for i in range(5)]  # 09:47 .. 09:51
        first = (restart - 10) * 1000  # 09:52, the first regular slot
        assert [slot for _, slot in sent_slots(app)] == caught_up[:1]
        backend = s.backend
        assert backend is not None
        states = {r.slot_ms: r.state for r in backend.history("once")}
        assert states[caught_up[0]] is State.SENT
        assert [states.get(slot) for slot in [*caught_up[1:], first]] == [State.SKIPPED] * 5
    finally:
        s.close()


@pytest.mark.services
def test_overlap_skip_while_the_previous_run_is_running(url: str) -> None:
    # The clock starts 10 s ahead of the real one (max_skew widened to let
    # it): the slot sent at the end is claimed with a 0.5 s window by the
    # backend's clock, and from the real now the set-up took up to 1.4 s of
    # the 2.5 s that left on a loaded machine.
    now = int(time.time()) + 10
    schedule = {"o": {"task": "t.o", "schedule": 1.0, "anarchon": {"overlap": "skip"}}}
    app = make_app(url, schedule, anarchon_max_late=0.5, anarchon_max_skew=120)
    worker = open_backend(app, "worker")
    request = ClaimRequest("o", (now - 1) * 1000, 60_000, 120_000, 10**15, 60_000)
    previous = worker.claim([request])[0]
    worker.mark(previous, State.SENT, task_id="p")
    assert worker.mark(previous, State.RUNNING)
    clock = Clock(float(now))
    s = Scheduler(app, clock=clock)
    try:
        s.tick()
        clock.now = now + 1
        s.tick()
        assert sent_slots(app) == []
        history = states(s, "o")
        assert history[now * 1000] is State.SKIPPED
        assert history[(now + 1) * 1000] is State.SKIPPED
        worker.mark(previous, State.SUCCEEDED)
        clock.now = now + 2
        s.tick()
        assert sent_slots(app) == [("o", (now + 2) * 1000)]
    finally:
        s.close()
        worker.close()


def test_overlap_skip_reads_each_deferred_slot_once(sqlite_url: str) -> None:
    # 400 jobs due at once, overlap='skip', a lease that allows batches of
    # 50 (2 s lease, 10 ms sends): 8 rounds. Each slot needs its previous
    # run read once (before the fix every round read every slot still waiting).
    jobs = 400
    app = jobs_app(
        sqlite_url,
        jobs,
        10.0,
        anarchon_lease_ttl=2,
        anarchon_overlap="skip",
    )
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    reads: list[str] = []
    try:
        assert s.backend is not None
        spy(s.backend, "history", reads, lambda job, limit=None: job)
        clock.now = slot + 0.1
        sent: list[tuple[str, int]] = []
        for _ in range(40):
            with delay_sends(0.01):
                s.tick()
            sent += sent_slots(app)
            if len(sent) >= jobs:
                break
        assert len(sent) == len(set(sent)) == jobs
        assert len(reads) <= 2 * jobs, f"{len(reads)} history reads for {jobs} slots"
    finally:
        s.close()
