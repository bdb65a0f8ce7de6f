"""Lease features in the scheduler, in one process on real lease backends:
catch-up after every instance was down, backup take-over, overlap skip,
hand-over, rendezvous spreading. Clocks start at the real time (the backends
judge claim windows and leases by their own clocks) and move by hand."""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, ClaimRequest, InstanceInfo, State
from celery_anarchon.beat.agenda import CLAIM, Slot
from celery_anarchon.beat.scheduler import Scheduler

from .conftest import backend_options, backend_url, require_service

pytestmark = pytest.mark.services

LEASE_BACKENDS = ["sqlite", "postgresql", "redis"]


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=LEASE_BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    name: str = request.param
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name == "postgresql":
        request.getfixturevalue("_sql_cleanup")
    return backend_url(name, tmp_path)


def make_app(url: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    tag = uuid.uuid4().hex[:6]
    app = Celery(f"lease-{tag}", set_as_current=False)
    # A namespace of this app's own under the run's prefix (the run's clean-up
    # still finds it): claims and registry entries of an earlier test in the
    # same worker (same job names, a slot in the same second, an instance not
    # yet stale) must not reach this one.
    prefix = backend_options(url.split(":")[0])["prefix"]  # sqlite, postgresql or redis
    settings: dict[str, Any] = {
        "broker_url": "memory://",
        "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
        "anarchon_backend": url,
        "anarchon_backend_options": {"prefix": f"{prefix}{tag}{prefix[-1]}"},
        "anarchon_jitter": 0,
        "beat_schedule": schedule,
        "timezone": "UTC",
    }
    app.conf.update({**settings, **conf})
    return app


def sent_slots(app: Celery) -> list[tuple[str, int]]:
    """``(job, slot)`` of every message on the app's queue, in queue order."""
    out = []
    with Connection("memory://") as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        while True:
            try:
                message = queue.get(timeout=0.05)
            except queue.Empty:
                break
            out.append((message.headers["anarchon_job"], message.headers["anarchon_slot"]))
            message.ack()
        queue.close()
    return out


def open_backend(app: Celery, instance: str) -> Backend:
    conf = app.conf
    backend = backend_from_url(
        conf.anarchon_backend, instance=instance, options=dict(conf.anarchon_backend_options)
    )
    backend.open()
    return backend


def record_sent(backend: Backend, job: str, slot_ms: int) -> None:
    """A run of ``job`` at ``slot_ms`` that an earlier instance sent."""
    claim = backend.claim([ClaimRequest(job, slot_ms, 10**9, 10_000, slot_ms + 3_600_000)])[0]
    assert claim.won
    backend.mark(claim, State.SENT, task_id=f"old-{slot_ms}")


# -- catch-up ----------------------------------------------------------------


def catch_up_app(url: str, policy: str, restart_s: int, **conf: Any) -> Celery:
    """The start-up scenario of docs/scheduling.md, shifted so that the restart (09:52:10) is now.

    ``ten`` fires every ten minutes with a slot at 09:50 (= restart - 130 s);
    ``one`` every minute with a slot at 09:52 (= restart - 10 s).
    """
    opts = {"catch_up": policy, "catch_up_limit": 5}
    schedule = {
        f"ten-{policy}": {
            "task": "t.ten",
            "schedule": 600.0,
            "anarchon": {**opts, "anchor": restart_s - 130},
        },
        f"one-{policy}": {
            "task": "t.one",
            "schedule": 60.0,
            "anarchon": {**opts, "anchor": restart_s - 10},
        },
    }
    return make_app(url, schedule, **conf)


def run_restart(url: str, policy: str) -> tuple[Celery, Scheduler, int]:
    restart = int(time.time())
    app = catch_up_app(url, policy, restart)
    before = open_backend(app, "before")
    record_sent(before, f"ten-{policy}", (restart - 1330) * 1000)  # 09:30
    record_sent(before, f"one-{policy}", (restart - 790) * 1000)  # 09:39
    before.close()
    s = Scheduler(app, clock=Clock(float(restart)))
    s.tick()
    return app, s, restart


def states(s: Scheduler, job: str) -> dict[int, State]:
    assert s.backend is not None
    return {r.slot_ms: r.state for r in s.backend.history(job)}


def at(restart: int, offset_s: int) -> int:
    return (restart + offset_s) * 1000


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


def test_catch_up_none_records_the_gap_as_missed(url: str) -> None:
    app, s, r = run_restart(url, "none")
    try:
        assert sent_slots(app) == [("one-none", at(r, -10))]
        ten = states(s, "ten-none")
        assert (ten[at(r, -730)], ten[at(r, -130)]) == (State.MISSED, State.MISSED)
    finally:
        s.close()


# -- backup runners ------------------------------------------------------------


def test_a_backup_takes_over_a_dead_owners_slot(url: str) -> None:
    now = int(time.time())
    schedule = {
        "b": {"task": "t.b", "schedule": 3600.0, "anarchon": {"lease_ttl": 1}},
    }
    slot = (now // 3600) * 3600 + 3600  # the next whole hour: slot of "b"
    app = make_app(url, schedule, anarchon_max_late=30, anarchon_max_skew=7200)
    dead = open_backend(app, "dead-owner")
    clock = Clock(float(slot))
    # Built (connected, tables made, first slots planned) before the dead
    # owner claims: on a loaded machine that took up to 0.97 s, most of the
    # dead owner's lease, and the first tick must still find it running.
    s = Scheduler(app, clock=clock)
    lease_s = 2.0
    held = dead.claim(
        [ClaimRequest("b", slot * 1000, 10**9, 10**9, slot * 1000 + 10**7, int(lease_s * 1000))]
    )
    lease_ends = time.monotonic() + lease_s  # at the latest (backend clock)
    try:
        assert held[0].won  # claimed, never sent: then its owner died
        s.tick()  # loses the race: the dead owner holds the slot
        assert sent_slots(app) == []
        time.sleep(max(lease_ends + 0.2 - time.monotonic(), 0.0))  # the dead owner's lease ends
        clock.now = slot + 3.5
        s.tick()
        assert sent_slots(app) == [("b", slot * 1000)]
        history = s.backend.history("b")  # type: ignore[union-attr]
        by_state = {r.state: r for r in history}
        assert by_state[State.SENT].instance == s.instance_id
        assert by_state[State.SENT].token == 2
        assert dead.mark(held[0], State.SENT, task_id="too-late") is False  # fenced out
    finally:
        s.close()
        dead.close()


# -- overlap protection --------------------------------------------------------


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


# -- hand-over and spreading ---------------------------------------------------


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


def test_rendezvous_spreads_a_burst_across_instances(url: str) -> None:
    now = int(time.time())
    slot = now + 2
    schedule = {
        f"j{i}": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}
        for i in range(300)
    }
    app = make_app(url, schedule, anarchon_jitter=1, anarchon_max_late=30)
    clock = Clock(float(now))
    schedulers = [Scheduler(app, clock=clock) for _ in range(3)]
    try:
        for s in schedulers:
            s.tick()  # registers; the second round reads every peer
        for s in schedulers:
            s.registry.next_heartbeat = 0
            s.tick()
            s.agenda.plan_first_slots()
        clock.now = slot
        for s in schedulers:
            s.tick()  # preferred owners claim at the slot
        clock.now = slot + 1
        for s in schedulers:
            s.tick()  # backups find every slot taken
        sent = sent_slots(app)
        assert sorted(sent) == sorted((f"j{i}", slot * 1000) for i in range(300))
        owners = Counter(
            r.instance
            for s in schedulers[:1]
            for i in range(300)
            for r in s.backend.history(f"j{i}")  # type: ignore[union-attr]
        )
        assert len(owners) == 3 and min(owners.values()) > 60, owners
    finally:
        for s in schedulers:
            s.close()


# -- registry: a lone instance, definition drift ------------------------------


def test_a_lone_instance_claims_at_the_slot(url: str) -> None:
    now = int(time.time())
    slot = now + 2
    schedule = {
        f"j{i}": {"task": "t.j", "schedule": 3600.0, "anarchon": {"anchor": slot}}
        for i in range(20)
    }
    app = make_app(url, schedule, anarchon_jitter=2)
    clock = Clock(float(now))
    alone = Scheduler(app, clock=clock)
    others: list[Scheduler] = []
    try:
        alone.registry.random.randint = lambda low, high: high  # type: ignore[method-assign]
        alone.tick()  # the first heartbeat: the registry shows this instance alone
        assert alone.registry.peers == [alone.instance_id]
        clock.now = slot
        alone.tick()  # claims at the slot, not after a random part of the jitter
        assert sorted(sent_slots(app)) == sorted((f"j{i}", slot * 1000) for i in range(20))
        # With a second instance, the preferred owner claims at once, the backup
        # after the jitter.
        others.append(Scheduler(app, clock=clock))
        others[0].tick()
        alone.registry.next_heartbeat = 0
        alone.tick()
        assert len(alone.registry.peers) == 2
        next_slot = (slot + 3600) * 1000
        delays = {alone.registry.claim_delay_ms(alone.jobs[f"j{i}"], next_slot) for i in range(20)}
        assert delays == {0, 2000}
    finally:
        for s in [alone, *others]:
            s.close()


def test_drift_is_warned_once_and_definitions_are_read_once(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def schedule(changed: float) -> dict[str, Any]:
        return {
            "same": {"task": "t.same", "schedule": 3600.0},
            "changed": {"task": "t.changed", "schedule": changed},
        }

    caplog.set_level(logging.WARNING, logger="celery_anarchon.beat")
    clock = Clock(float(int(time.time())))
    app_a = make_app(url, schedule(3600.0))
    shared = app_a.conf.anarchon_backend_options  # one registry for both
    a = Scheduler(app_a, clock=clock)
    b = Scheduler(make_app(url, schedule(1800.0), anarchon_backend_options=shared), clock=clock)
    try:
        assert a.backend is not None
        read: list[str] = []
        sent_jobs: list[int] = []
        definitions, register = a.backend.definitions, a.backend.register

        def spy_definitions(instance: str) -> dict[str, str]:
            read.append(instance)
            return definitions(instance)

        def spy_register(info: InstanceInfo, ttl_ms: int) -> bool:
            sent_jobs.append(len(info.jobs))
            return register(info, ttl_ms)

        monkeypatch.setattr(a.backend, "definitions", spy_definitions)
        monkeypatch.setattr(a.backend, "register", spy_register)
        b.tick()
        for _ in range(3):
            a.registry.next_heartbeat = 0
            a.tick()
        assert read == [b.instance_id]  # once, though three heartbeats saw b
        assert sent_jobs == [2, 0, 0]  # definitions with the first heartbeat only
        warned = [r.getMessage() for r in caplog.records if "defined differently" in r.getMessage()]
        assert len(warned) == 1 and "job changed" in warned[0] and b.instance_id in warned[0]
    finally:
        a.close()
        b.close()
