"""Hand-over and shutdown: claims won but not sent are released or recorded,
failed sends are left to a backup while one can still send them, and a
closed scheduler never ticks on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import celery_anarchon.beat.publisher as publisher_module
from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import State
from celery_anarchon.beat.agenda import CLAIM, Slot
from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.exceptions import BackendUnavailable

from ..conftest import REDIS_URL, require_service
from .support import (
    SEND_DELAY,
    Clock,
    CountingRefuser,
    app_with_slot,
    hourly_at,
    jobs_app,
    make_app,
    next_slot,
    open_backend,
    records,
    sent_slots,
)


@pytest.mark.services
def test_a_backup_takes_a_handed_over_slot_whose_lease_outlives_max_late() -> None:
    """With ``lease_ttl`` (30 s) beyond ``max_late`` (20 s) a loser planned
    no take-over at all, so a slot its owner released on shutdown was
    sent by nobody and, released, had no record. Now the loser remembers
    the slot and checks it as soon as the owner leaves the registry."""
    require_service("redis")
    now = int(time.time())
    slot_s = now + 2
    app = make_app(REDIS_URL, hourly_at(slot_s), anarchon_lease_ttl=30, anarchon_max_late=20)
    clock = Clock(float(now))
    a, b = Scheduler(app, clock=clock), Scheduler(app, clock=clock)
    try:
        a.tick()
        b.tick()  # both registered; b knows a
        assert sorted(b.registry.peers) == sorted([a.instance_id, b.instance_id])
        assert a.backend is not None and b.backend is not None
        request = a.jobs["h"].claim_request(slot_s * 1000, 10)
        [won] = a.backend.claim([request])
        a.claimer.hold(Slot(a.jobs["h"], slot_s * 1000, CLAIM), won)  # not yet sent (SIGTERM comes)
        clock.now = slot_s
        b.tick()  # b tries the slot and loses it
        assert sent_slots(app) == []
        clock.now = slot_s + 1
        a.close()  # hands the slot over
        clock.now = slot_s + 6  # b's next heartbeat: a has left
        b.tick()
        assert sent_slots(app) == [("h", slot_s * 1000)]
        [record] = [r for r in b.backend.history("h") if r.slot_ms == slot_s * 1000]
        assert (record.state, record.instance) == (State.SENT, b.instance_id)
    finally:
        a.close()
        b.close()


@pytest.mark.services
def test_a_held_slot_too_late_to_hand_over_is_recorded_lost() -> None:
    require_service("redis")
    now = int(time.time())
    slot_s = now - 15
    app = make_app(REDIS_URL, hourly_at(slot_s), anarchon_lease_ttl=30, anarchon_max_late=20)
    s = Scheduler(app, clock=Clock(float(now)))
    assert s.backend is not None
    try:
        request = s.jobs["h"].claim_request(slot_s * 1000, 10)
        [won] = s.backend.claim([request])
        s.claimer.hold(Slot(s.jobs["h"], slot_s * 1000, CLAIM), won)  # 5 s left: too late
    finally:
        s.close()
    other = open_backend(app, "other")
    try:
        [record] = other.history("h")
        assert record.state is State.LOST
        assert "too late to hand over" in (record.error or "")
        assert not other.claim([request])[0].won  # closed, not released
    finally:
        other.close()


@pytest.mark.services
def test_a_failed_send_no_backup_can_take_over_is_recorded_lost_on_shutdown(
    refuser: CountingRefuser,
) -> None:
    """A send failed (broker away); its lease (30 s) ends after ``max_late``
    (20 s), so no backup can take it over. Its ``lost`` record was due at
    ``max_late``, from this instance: on shutdown before that it is written
    at once, with the reason."""
    require_service("redis")
    now = int(time.time())
    app = make_app(REDIS_URL, hourly_at(now), anarchon_lease_ttl=30, anarchon_max_late=20)
    app.conf.broker_url = f"redis://127.0.0.1:{refuser.port}/0"
    s = Scheduler(app, clock=Clock(float(now)))
    try:
        s.tick()
        assert s.backend is not None
        [record] = s.backend.history("h")
        assert record.state is State.CLAIMED  # the send failed
    finally:
        s.close()
    other = open_backend(app, "other")
    try:
        [record] = other.history("h")
        assert record.state is State.LOST
        assert "send failed" in (record.error or "")
        assert "no backup took it over" in (record.error or "")
    finally:
        other.close()


@pytest.mark.services
def test_a_closed_scheduler_never_ticks_on(tmp_path: Path) -> None:
    """Beat closes the scheduler in its SIGTERM handler and raises
    SystemExit wherever the main thread is; redis-py reading the socket
    close() had shut turned it into ``ValueError: I/O operation on closed
    file``, which a tick survived: the beat reconnected and kept sending
    after its hand-over until killed (seen in a real beat, 1 in 16 stops
    under load). A tick after close() now exits."""
    # A slot 3 s ahead, ticked once due: a new job sends no slot from more
    # than 1 s before its start-up, which a loaded machine can take.
    slot_s = int(time.time()) + 3
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", hourly_at(slot_s))
    app.conf.anarchon_backend_options = {}
    s = Scheduler(app)
    time.sleep(max(0.0, slot_s + 0.05 - time.time()))
    s.tick()
    s.close()
    with pytest.raises(SystemExit):
        s.tick()
    assert sent_slots(app) == [("h", int(app.conf.beat_schedule["h"]["anarchon"]["anchor"]) * 1000)]


@pytest.mark.services
@pytest.mark.integration
def test_real_beats_hand_a_slot_over_on_sigterm_when_the_lease_outlives_max_late(
    tmp_path: Path,
) -> None:
    """Three real beats on Redis, ``lease_ttl`` 20 s beyond ``max_late``
    16 s. One beat takes 6 s from each won claim to its send
    (``tests.beat.support.SEND_DELAY``) and gets SIGTERM holding a slot the
    others tried and lost: another
    beat sends that slot once, and every due slot is published or on the
    record. Before, nobody planned a check of a slot whose lease outlives
    ``max_late``: the released slot was never sent and had no record."""

    from ..beats import instance_prefix
    from ..faults.harness import MISS_STATES, FaultRun, wait_until

    require_service("redis")
    job = "every-2s"
    conf = {
        "anarchon_lease_ttl": 20.0,
        "anarchon_max_late": 16.0,
        "anarchon_jitter": 1.0,
        "anarchon_registry_ttl": 10.0,
    }
    with FaultRun("redis", tmp_path, conf=conf, schedules={job: "* * * * * */2"}) as run:
        run.start(2, worker=False)
        time.sleep(3.0)
        victim = run.cluster.start(1, conf={SEND_DELAY: 6.0})[0]
        # Set-up, not the check: the victim's first tick sleeps 6 s for each
        # slot it wins, and on a loaded CI machine has run past 30 s (as in
        # tests/beat/test_lease_faults.py).
        assert run.cluster.wait_ticking([victim], timeout=90), run.cluster.logs()
        since_ms = int(time.time() + HEARTBEAT_INTERVAL + 1) * 1000  # all beats know each other
        held = run.wait_for_held(victim, job, since_ms=since_ms, timeout=30)
        assert held is not None, run.cluster.logs()
        # After the backups tried the slot (at its jitter) and lost it, so
        # only a take-over check can send it; before the victim's send.
        time.sleep(max(held.slot_ms / 1000 + 3.0 - time.time(), 0.0))
        records = run.history([job])[job]
        [now_held] = [r for r in records if r.slot_ms == held.slot_ms]
        assert (now_held.state, now_held.token) == (State.CLAIMED, held.token), records
        run.cluster.stop([victim], timeout=15)
        assert victim.returncode == 0, run.cluster.logs()

        def sent() -> bool:
            records = run.history([job])[job]
            return any(r.slot_ms == held.slot_ms and r.state is State.SENT for r in records)

        wait_until(sent, 2 * HEARTBEAT_INTERVAL + 5, 0.2)
        time.sleep(2.0)
        run.stop()
        outcome = run.outcome(tail_s=4.0)
    logs = run.cluster.logs()
    slot = (job, held.slot_ms)
    assert outcome.published[slot] == 1, logs
    [record] = [r for r in outcome.records(*slot) if r.state is State.SENT]
    assert not (record.instance or "").startswith(instance_prefix(victim)), logs
    assert outcome.duplicate_publishes() == {}, logs
    unaccounted = [
        s
        for s in outcome.due
        if s not in outcome.published
        and not any(r.state in MISS_STATES for r in outcome.records(*s))
    ]
    assert unaccounted == [], (unaccounted, logs)


@pytest.mark.services
def test_close_called_in_the_middle_of_a_tick_waits_for_the_tick_to_unwind(
    tmp_path: Path,
) -> None:
    """Beat's SIGTERM handler calls close() wherever the main thread is. In
    the middle of a tick, the thread may hold a client library's lock that
    is not reentrant (redis-py's pool lock), so recording and handing over
    from there could wait for ever: a real beat on RabbitMQ once hung 20 s
    after SIGTERM and was killed. close() inside a tick only asks; beat's
    second close() (after the tick unwound) does the work, and a tick that
    comes first closes and exits."""
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", hourly_at(int(time.time())))
    app.conf.anarchon_backend_options = {}
    s = Scheduler(app)
    backend = s.backend
    seen: list[tuple[bool, bool]] = []

    def closing_pop_due(now_ms: int, most: int | None = None) -> list[Slot]:  # mid-tick signal
        s.close()
        seen.append((s.closed, backend is not None and s.link.ready))
        return []

    s.agenda.pop_due = closing_pop_due  # type: ignore[method-assign]
    s.tick()
    assert seen == [(False, True)]  # asked only: nothing closed inside the tick
    with pytest.raises(SystemExit):
        s.tick()  # the next tick closes, then exits
    assert s.closed and not s.link.ready
    s.close()  # and beat's own close() after that is harmless


@pytest.mark.services
def test_close_releases_claims_won_but_not_sent(url: str) -> None:
    now = int(time.time())
    app = make_app(url, {"h": {"task": "t.h", "schedule": 3600.0}})
    s = Scheduler(app, clock=Clock(float(now)))
    request = s.jobs["h"].claim_request(now * 1000, 10)
    claim = s.backend.claim([request])[0]  # type: ignore[union-attr]
    slot = Slot(s.jobs["h"], now * 1000, CLAIM)
    s.claimer.hold(slot, claim)  # as if SIGTERM hit between claim and send
    s.close()
    other = open_backend(app, "other")
    try:
        assert other.claim([request])[0].won
    finally:
        other.close()


def test_close_after_a_blip_still_records_what_was_sent(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend answers again by the time beat shuts down; only one
    # mark_many call failed (a blip). A graceful shutdown must not leave the
    # published slot to a backup: that is not the die-or-freeze window.
    app = jobs_app(sqlite_url, 3, 10.0, anarchon_lease_ttl=1)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    assert s.backend is not None
    real_mark_many = s.backend.mark_many
    failed: list[int] = []

    def blip(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(1)
            raise BackendUnavailable("blip")
        return real_mark_many(*args, **kwargs)

    monkeypatch.setattr(s.backend, "mark_many", blip)
    clock.now = slot + 0.1
    s.tick()
    assert len(sent_slots(app)) == 3
    assert len(s.journal.unmarked) == 3
    s.close()  # SIGTERM right after the blip: the backend answers again
    check = backend_from_url(sqlite_url, instance="checker")
    check.open()
    try:
        states = [check.history(f"job-{i:04d}")[0].state for i in range(3)]
        time.sleep(1.2)  # the 1 s lease ends: would a backup take over?
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(3)]
        taken = [c.won for c in check.take_over_many(requests)]
        assert states == [State.SENT] * 3 and taken == [False] * 3, (states, taken)
    finally:
        check.close()


def test_shutdown_leaves_a_failed_send_to_the_backup_while_it_can_still_send_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wins the slot, but its publish fails (A cannot reach Celery's
    # broker): the claim is left to a backup at lease end (1 s). B lost the
    # race and checks at lease end. A is stopped just after its lease ended,
    # 28 s before max_late: B can take the slot over and send it.

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    app, slot_ms, before = app_with_slot(url, anarchon_max_late=30)
    clock_a, clock_b = Clock(before), Clock(before)
    a = Scheduler(app, clock=clock_a)
    b = Scheduler(app, clock=clock_b)
    real_send = publisher_module.send_slot
    broker_down = [True]

    def send(*args: Any, **kwargs: Any) -> Any:
        if broker_down[0]:
            raise ConnectionRefusedError("A cannot reach Celery's broker")
        return real_send(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "send_slot", send)
    try:
        a.tick()
        b.tick()
        clock_a.now = clock_b.now = slot_ms / 1000
        a.tick()  # A alone in its view: claims at the slot, the publish fails
        b.tick()  # B loses the race: a take-over check at the lease's end
        assert [r.state for r in records(a, slot_ms)] == [State.CLAIMED]
        assert ("k", slot_ms) in b.take_over.watching
        broker_down[0] = False
        time.sleep(1.2)  # A's lease ends (backend clock)
        clock_a.now = clock_b.now = slot_ms / 1000 + 1.3
        a.close()  # SIGTERM: 28 s before max_late
        b.registry.next_heartbeat = 0  # B's heartbeat sees A leave
        for step in (1.5, 2.0, 3.0, 5.0):
            clock_b.now = slot_ms / 1000 + step
            b.tick()
        states = [r.state for r in records(b, slot_ms)]
        assert sent_slots(app) == [("k", slot_ms)], states
    finally:
        a.close()
        b.close()
        open_backend(app, "x").close()
