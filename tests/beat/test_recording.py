"""Recording: ``sent`` in chunks, ``missed`` records for slots later than
``max_late`` (batched, each counted once), and marks that never move a run
back."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import ClaimRequest, State
from celery_anarchon.beat.journal import MARK_CHUNK, RECORD_CHUNK
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.message import task_id_for

from ..conftest import backend_options
from .support import (
    Clock,
    jobs_app,
    next_slot,
    open_backend,
    record_sent,
    sent_messages,
    sent_slots,
    spy,
    sqlite_app,
    tick_until,
)


def test_a_slot_later_than_max_late_is_recorded_missed_not_sent(
    t0: float, tmp_path: Path, every_second: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=2)
    before = open_backend(app, "before")
    record_sent(before, "tick", int((t0 - 2) * 1000))  # a known job: no first-deploy start
    before.close()
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        clock.now = t0 + 10.5  # slots t0-1 .. t0+8 are more than 2 s late
        with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
            s.tick()
        sent = sorted(h["anarchon_slot"] for h in sent_messages(app))
        assert sent == [int((t0 + i) * 1000) for i in (9, 10)]
        history = s.backend.history("tick")  # type: ignore[union-attr]
        missed = sorted(r.slot_ms for r in history if r.state is State.MISSED)
        assert missed == [int((t0 + i) * 1000) for i in range(-1, 9)]
        assert "missed 10 slot(s) of tick" in caplog.text
    finally:
        s.close()


def test_sent_is_recorded_in_chunks(sqlite_url: str) -> None:
    jobs = 2 * MARK_CHUNK + 50
    app = jobs_app(sqlite_url, jobs, 10.0)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    chunks: list[int] = []
    single: list[Any] = []
    try:
        assert s.backend is not None
        spy(s.backend, "mark_many", chunks, lambda claims, state, **kw: len(claims))
        spy(s.backend, "mark", single, lambda claim, state, **kw: state)
        clock.now = slot + 0.1
        tick_until(s, lambda: sum(chunks) >= jobs)
        slot_ms = int(slot * 1000)
        assert sorted(sent_slots(app)) == [(f"job-{i:04d}", slot_ms) for i in range(jobs)]
        assert sum(chunks) == jobs and max(chunks) <= MARK_CHUNK and len(chunks) >= 3
        assert single == []  # no per-slot round trip
        for i in (0, jobs // 2, jobs - 1):
            [record] = s.backend.history(f"job-{i:04d}")
            assert record.state is State.SENT
            assert record.task_id == task_id_for(
                f"job-{i:04d}", slot_ms, namespace=s.backend.namespace
            )
    finally:
        s.close()


def test_misses_of_a_round_are_recorded_in_batches(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The instance wakes past max_late (5 s) for every job's slot: nothing is
    # sent, and the 600 misses go to the backend in RECORD_CHUNK-sized calls,
    # not one call per slot.
    jobs = RECORD_CHUNK + 100
    app = jobs_app(sqlite_url, jobs, 10.0)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        s.tick()
        spy(s.backend, "record_many_if_absent", batches, lambda records: len(records))
        assert not hasattr(s.backend, "record_if_absent")  # no one-by-one form
        clock.now = slot + 6
        with caplog.at_level("WARNING", logger="celery_anarchon.beat"):
            s.tick()
        assert batches == [RECORD_CHUNK, 100]
        assert sent_slots(app) == []
        slot_ms = int(slot * 1000)
        for name in (f"job-{i:04d}" for i in (0, RECORD_CHUNK - 1, RECORD_CHUNK, jobs - 1)):
            [record] = s.backend.history(name)
            assert (record.slot_ms, record.state, record.error) == (
                slot_ms,
                State.MISSED,
                "later than max_late",
            )
        assert caplog.text.count("missed 1 slot(s) of job-") == jobs
        # The next slot, 10 s later, is claimed and sent as usual.
        clock.now = slot + 10.1
        s.tick()
        assert len(sent_slots(app)) == jobs
    finally:
        s.close()


def test_a_job_late_twice_in_one_round_counts_each_missed_slot_once(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A backup claims 4 s after the slot; it stalls past max_late (5 s) of
    # that pending claim and of the job's next slot: one round holds two late
    # events of one job (review finding: the metric counted 4 for 2 slots).
    app = jobs_app(sqlite_url, 1, 10.0, anarchon_jitter=4)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    counted: list[tuple[str, int]] = []
    try:
        monkeypatch.setattr(s.registry, "claim_delay_ms", lambda job, slot_ms: 4000)
        monkeypatch.setattr(s.metrics, "missed", lambda job, n=1: counted.append((job, n)))
        s.tick()
        clock.now = slot + 0.1
        s.tick()  # the slot is due: its claim is planned 4 s later
        clock.now = slot + 16  # past max_late of the slot and of the next one
        with caplog.at_level("WARNING", logger="celery_anarchon.beat"):
            s.tick()
        assert s.backend is not None
        history = s.backend.history("job-0000")
        assert sorted((r.slot_ms, r.state) for r in history) == [
            (int(slot * 1000), State.MISSED),
            (int(slot * 1000) + 10_000, State.MISSED),
        ]
        assert counted == [("job-0000", 2)]
        assert caplog.text.count("missed 2 slot(s) of job-0000") == 1
    finally:
        s.close()


@pytest.mark.services
def test_a_retried_sent_mark_never_moves_a_finished_run_back(lease_url: str) -> None:
    # mark_many may be sent again whole after a partial failure (its
    # contract); by then the worker may have recorded running, then
    # succeeded. The retry must answer True (no false 'taken over' warning)
    # and leave the run succeeded; a superseded token's retry is refused.

    scheme = lease_url.split(":")[0].split("+")[0]
    options = backend_options("postgresql" if scheme == "postgresql" else scheme)
    owner = backend_from_url(lease_url, instance="owner", options=options)
    owner.open()
    try:
        slot_ms = (int(time.time()) + 1) * 1000
        job = f"retry-{slot_ms}"
        request = ClaimRequest(job, slot_ms, 10**9, 10**9, slot_ms + 10**7, 30_000)
        other = ClaimRequest(job + "-b", slot_ms, 10**9, 10**9, slot_ms + 10**7, 30_000)
        claim, claim_b = owner.claim([request, other])
        assert claim.won and claim_b.won
        assert owner.mark_many([claim, claim_b], State.SENT, task_ids=["t1", "t2"]) == [True] * 2
        assert owner.mark(claim, State.RUNNING)
        assert owner.mark(claim, State.SUCCEEDED)
        again = owner.mark_many([claim, claim_b], State.SENT, task_ids=["t1", "t2"])
        assert again == [True, True]
        [record] = owner.history(job)
        assert record.state is State.SUCCEEDED
        assert owner.history(job + "-b")[0].state is State.SENT
    finally:
        owner.close()
