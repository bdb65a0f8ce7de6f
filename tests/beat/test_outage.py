"""The claim backend away: beat stays alive and sends nothing unclaimed, and
what could not be recorded (``sent`` marks, misses, the catch-up gap) is
written once it answers."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

import celery_anarchon.beat.publisher as publisher_module
from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, State
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.message import task_id_for

from ..faults.servers import RedisServer
from .support import (
    Clock,
    jobs_app,
    make_app,
    next_slot,
    open_backend,
    record_finished,
    sent_messages,
    sent_slots,
    sqlite_app,
    tick_for,
)


def test_an_unreachable_backend_keeps_beat_alive_and_sends_nothing(
    t0: float, tmp_path: Path, every_second: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_backend="redis://127.0.0.1:1/0")
    clock = Clock(t0 + 0.5)
    with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
        s = Scheduler(app, clock=clock)
        for step in range(1, 6):
            clock.now = t0 + step
            assert s.tick() >= 0
    assert sent_messages(app) == []
    outages = [r for r in caplog.records if "is unavailable" in r.getMessage()]
    assert [r.levelname for r in outages] == ["WARNING"]  # once per outage, not per slot
    s.close()
    s.close()


@pytest.mark.services
def test_the_gap_is_settled_once_a_backend_down_at_start_up_answers(tmp_path: Path) -> None:
    """Every instance was down; the one that restarts finds the backend down
    too. Once the backend answers, the slots since its last record are
    recorded missed (``catch_up='none'``) or caught up (``'all'``), as at a
    start with the backend up; they used to be left unrecorded."""
    from ..faults.servers import RedisServer

    restart = int(time.time())
    minute = {"task": "t.m", "schedule": 60.0}
    schedule = {
        "none": {**minute, "anarchon": {"anchor": restart - 10}},
        "all": {
            **minute,
            "anarchon": {"anchor": restart - 10, "catch_up": "all", "catch_up_limit": 3},
        },
    }
    server = RedisServer(tmp_path)
    server.start()
    try:
        app = make_app(f"redis://127.0.0.1:{server.port}/0", schedule)
        before = open_backend(app, "before")
        for job in schedule:
            record_finished(before, job, (restart - 790) * 1000)  # ran 13 minutes ago
        before.close()
        server.crash()
        s = Scheduler(app)  # the backend is down at start-up
        try:
            s.tick()
            assert s.agenda.unsettled  # nothing could be settled yet
            server.start()
            assert tick_for(s, lambda: not s.agenda.unsettled, 30)
            tick_for(s, lambda: False, 1.5)  # the catch-up sends
            backend = s.backend
            assert backend is not None
            gap = [(restart - 730 + 60 * i) * 1000 for i in range(12)]  # 09:40 .. 09:51
            none_states = {r.slot_ms: r.state for r in backend.history("none")}
            assert all(none_states.get(slot) is State.MISSED for slot in gap), none_states
            all_states = {r.slot_ms: r.state for r in backend.history("all")}
            assert all(all_states.get(slot) is State.MISSED for slot in gap[:-3]), all_states
            sent = [slot for job, slot in sent_slots(app) if job == "all"]
            assert sent[:3] == gap[-3:]  # the newest three, oldest first
            assert all(all_states.get(slot) is State.SENT for slot in gap[-3:]), all_states
        finally:
            s.close()
    finally:
        server.crash()


@pytest.mark.services
def test_sent_marks_lost_to_an_outage_are_retried(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Redis dies between the publish and the 'sent' mark: the marks stay
    # queued, and once Redis is back (its append-only file kept the claims)
    # they are recorded, so no backup takes the slots over at lease end.
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    app = jobs_app(url, 5, 10.0, anarchon_lease_ttl=2)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = publisher_module.send_slot

    def send_then_crash(*args: Any, **kwargs: Any) -> Any:
        if own_redis.proc is not None:
            own_redis.crash()  # after the claims, before the marks
        return real_send(*args, **kwargs)

    backup: Backend | None = None
    try:
        monkeypatch.setattr(publisher_module, "send_slot", send_then_crash)
        clock.now = slot + 0.1
        s.tick()
        assert sorted(sent_slots(app)) == [(f"job-{i:04d}", slot_ms) for i in range(5)]
        assert len(s.journal.unmarked) == 5  # kept for a retry
        own_redis.start()
        monkeypatch.setattr(publisher_module, "send_slot", real_send)
        clock.now = slot + 5  # past the reconnect backoff
        s.tick()
        assert s.journal.unmarked == []
        backup = backend_from_url(url, instance="backup")
        backup.open()
        for i in range(5):
            [record] = backup.history(f"job-{i:04d}")
            assert (record.state, record.task_id) == (
                State.SENT,
                task_id_for(f"job-{i:04d}", slot_ms, namespace=backup.namespace),
            )
        time.sleep(2.2)  # the 2 s lease ends: a backup checks the slots
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(5)]
        assert [c.won for c in backup.take_over_many(requests)] == [False] * 5
        assert sent_slots(app) == []
    finally:
        s.close()
        if backup is not None:
            backup.close()


@pytest.mark.services
def test_misses_while_the_backend_is_away_are_recorded_once_it_is_back(
    own_redis: RedisServer,
) -> None:
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    app = jobs_app(url, 5, 10.0)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    reader: Backend | None = None
    try:
        s.tick()
        own_redis.crash()
        clock.now = slot + 6  # every slot past max_late while Redis is down
        s.tick()
        assert sorted(job.name for job, *_ in s.journal.unrecorded) == [
            f"job-{i:04d}" for i in range(5)
        ]
        own_redis.start()
        clock.now = slot + 9  # past the reconnect backoff, before the next slot
        s.tick()
        assert list(s.journal.unrecorded) == []
        reader = backend_from_url(url, instance="reader")
        reader.open()
        for i in range(5):
            [record] = reader.history(f"job-{i:04d}")
            assert (record.slot_ms, record.state) == (slot_ms, State.MISSED)
        assert sent_slots(app) == []
    finally:
        s.close()
        if reader is not None:
            reader.close()


@pytest.mark.services
def test_the_back_line_counts_each_slot_not_sent_once(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, item 7: "back after 31.0s; N slot(s) were not sent by this
    instance meanwhile" counted a slot again at every reconnect attempt
    that planned it again (2x for a 30 s outage, 3-4x for 120 s). N is the
    number of distinct slots this instance could not claim."""
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    jobs = 3
    app = jobs_app(url, jobs, 1.0, anarchon_jitter=0)
    slot = next_slot(1.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    try:
        s.tick()
        own_redis.crash()
        for step in range(61):  # slots slot .. slot + 30 fall due while Redis is down
            clock.now = slot + step / 2
            s.tick()
        own_redis.start()
        clock.now = slot + 31.5  # past the reconnect backoff (1 + 2 + 4 + 8 + 16 s)
        with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
            s.tick()
    finally:
        s.close()
    [back] = [r.getMessage() for r in caplog.records if "is back after" in r.getMessage()]
    assert f"; {jobs * 31} slot(s) were not sent by this instance meanwhile" in back, back
