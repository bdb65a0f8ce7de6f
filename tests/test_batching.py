"""The scheduler's batching, in one process on real backends: ``sent``
recorded in chunks (``Backend.mark_many``), claims limited to what the lease
allows, take-over checks in one batch (``Backend.take_over_many``), and
``sent`` marks kept and retried across a backend outage (issue 5: a mark
lost to a blip left the slot ``claimed`` for a backup to publish again).

Clocks start at the real time (the backends judge claim windows and leases
by their own clocks) and move by hand."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

import celery_anarchon.scheduler as scheduler_module
from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import Backend, State
from celery_anarchon.scheduler import (
    MARK_CHUNK,
    MIN_CLAIM_BATCH,
    RECORD_CHUNK,
    Scheduler,
    task_id_for,
)

from .faults.servers import RedisServer
from .test_lease_features import Clock, sent_slots


def make_app(url: str, jobs: int, period: float, **conf: Any) -> Celery:
    app = Celery(f"batch-{uuid.uuid4().hex[:6]}", set_as_current=False)
    settings: dict[str, Any] = {
        "broker_url": "memory://",
        "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
        "anarchon_backend": url,
        "anarchon_jitter": 0,
        "anarchon_max_skew": 120,  # the test clock may run ahead of the real one
        "anarchon_max_late": 5,  # below the period: only the next slot is due
        "beat_schedule": {
            f"job-{i:04d}": {"task": "proj.job", "schedule": period} for i in range(jobs)
        },
        "timezone": "UTC",
    }
    app.conf.update({**settings, **conf})
    return app


def next_slot(period: float) -> float:
    """The first slot of an epoch-anchored ``period`` at least 1 s ahead."""
    return (int(time.time() + 1) // int(period) + 1) * period


def spy(obj: Any, name: str, calls: list[Any], arg: Callable[..., Any]) -> None:
    """Record ``arg(*args)`` of every call of ``obj.name``, then call it."""
    real = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(arg(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def tick_until(s: Scheduler, done: Callable[[], bool], rounds: int = 50) -> None:
    for _ in range(rounds):
        s.tick()
        if done():
            return


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'claims.db'}"


def test_sent_is_recorded_in_chunks(sqlite_url: str) -> None:
    jobs = 2 * MARK_CHUNK + 50
    app = make_app(sqlite_url, jobs, 10.0)
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
            assert record.task_id == task_id_for(f"job-{i:04d}", slot_ms)
    finally:
        s.close()


@pytest.mark.parametrize(("lease", "delay", "most"), [(2.0, 0.01, MIN_CLAIM_BATCH), (30.0, 0, 200)])
def test_a_claim_batch_fits_in_a_share_of_the_lease(
    sqlite_url: str, lease: float, delay: float, most: int
) -> None:
    # 200 slots due at once. With a 2 s lease and sends slowed to 10 ms
    # each, a batch may hold only what is sent in 0.5 s: the smallest batch;
    # the rest waits in the heap. With a 30 s lease, one batch takes all.
    app = make_app(sqlite_url, 200, 10.0, anarchon_lease_ttl=lease, anarchon_test_send_delay=delay)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "claim", batches, lambda requests: len(requests))
        clock.now = slot + 0.1
        tick_until(s, lambda: sum(batches) >= 200)
        assert max(batches) == most and sum(batches) == 200
        sent = sent_slots(app)
        assert len(sent) == 200 and len(set(sent)) == 200
        states = Counter(s.backend.history(f"job-{i:04d}")[0].state for i in range(200))
        assert states == Counter({State.SENT: 200})
    finally:
        s.close()


def test_take_over_checks_of_a_round_go_in_one_batch(sqlite_url: str) -> None:
    # A dead owner claimed 20 slots: 10 it sent, 10 it never did (a 1 ms
    # lease, long expired). The backup loses all 20 at the slot, then checks
    # them in one batched call once its lease (1 s) ends, and sends the 10.
    app = make_app(sqlite_url, 20, 10.0, anarchon_lease_ttl=1)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    dead = backend_from_url(sqlite_url, instance="dead-owner")
    dead.open()
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    batches: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "take_over_many", batches, lambda requests: len(requests))
        assert not hasattr(s.backend, "take_over")  # no one-by-one form to fall back on
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(20)]
        expired = [r.__class__(**{**r.__dict__, "lease_ms": 1}) for r in requests[:10]]
        claims = dead.claim(expired + requests[10:])
        assert all(c.won for c in claims)
        assert all(dead.mark_many(claims[10:], State.SENT, task_ids=["t"] * 10))
        clock.now = slot + 0.1
        s.tick()
        assert sent_slots(app) == [] and batches == []
        clock.now = slot + 3.0  # the backup's lease plus its jitter, rounded
        s.tick()
        assert batches == [20]
        assert sorted(sent_slots(app)) == [(f"job-{i:04d}", slot_ms) for i in range(10)]
        for i in range(20):
            states = [r.state for r in s.backend.history(f"job-{i:04d}")]
            assert states == ([State.SENT, State.SUPERSEDED] if i < 10 else [State.SENT])
    finally:
        s.close()
        dead.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
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
    app = make_app(url, 5, 10.0, anarchon_lease_ttl=2)
    slot = next_slot(10.0)
    slot_ms = int(slot * 1000)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = scheduler_module.send_slot

    def send_then_crash(*args: Any, **kwargs: Any) -> Any:
        if own_redis.proc is not None:
            own_redis.crash()  # after the claims, before the marks
        return real_send(*args, **kwargs)

    backup: Backend | None = None
    try:
        monkeypatch.setattr(scheduler_module, "send_slot", send_then_crash)
        clock.now = slot + 0.1
        s.tick()
        assert sorted(sent_slots(app)) == [(f"job-{i:04d}", slot_ms) for i in range(5)]
        assert len(s._unmarked) == 5  # kept for a retry
        own_redis.start()
        monkeypatch.setattr(scheduler_module, "send_slot", real_send)
        clock.now = slot + 5  # past the reconnect backoff
        s.tick()
        assert s._unmarked == []
        backup = backend_from_url(url, instance="backup")
        backup.open()
        for i in range(5):
            [record] = backup.history(f"job-{i:04d}")
            assert (record.state, record.task_id) == (
                State.SENT,
                task_id_for(f"job-{i:04d}", slot_ms),
            )
        time.sleep(2.2)  # the 2 s lease ends: a backup checks the slots
        requests = [s.jobs[f"job-{i:04d}"].claim_request(slot_ms, 120) for i in range(5)]
        assert [c.won for c in backup.take_over_many(requests)] == [False] * 5
        assert sent_slots(app) == []
    finally:
        s.close()
        if backup is not None:
            backup.close()


def test_a_batch_sending_slower_than_its_lease_allows_gives_the_rest_back(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each send takes 0.1 s of the scheduler's clock and the lease is 1.2 s:
    # a batch may send for 0.4 s (a third of the lease), then releases the
    # rest, which is claimed afresh (a full lease each time) and sent.
    app = make_app(sqlite_url, 20, 10.0, anarchon_lease_ttl=1.2)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = scheduler_module.send_slot

    def slow_send(*args: Any, **kwargs: Any) -> Any:
        clock.now += 0.1
        return real_send(*args, **kwargs)

    batches: list[int] = []
    released: list[int] = []
    try:
        assert s.backend is not None
        spy(s.backend, "claim", batches, lambda requests: len(requests))
        spy(s.backend, "release", released, lambda claims: len(claims))
        monkeypatch.setattr(scheduler_module, "send_slot", slow_send)
        clock.now = slot + 0.1
        sent_slots_seen: list[tuple[str, int]] = []

        def all_sent() -> bool:
            sent_slots_seen.extend(sent_slots(app))
            return len(sent_slots_seen) >= 20

        with caplog.at_level("INFO", logger="celery_anarchon.scheduler"):
            tick_until(s, all_sent)
        slot_ms = int(slot * 1000)
        assert sorted(sent_slots_seen) == [(f"job-{i:04d}", slot_ms) for i in range(20)]
        assert batches[0] == 20 and len(batches) >= 3 and released and released[0] >= 10
        assert "claimed afresh" in caplog.text
        for i in range(20):
            [record] = s.backend.history(f"job-{i:04d}")
            assert record.state is State.SENT
    finally:
        s.close()


def test_misses_of_a_round_are_recorded_in_batches(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The instance wakes past max_late (5 s) for every job's slot: nothing is
    # sent, and the 600 misses go to the backend in RECORD_CHUNK-sized calls,
    # not one call per slot.
    jobs = RECORD_CHUNK + 100
    app = make_app(sqlite_url, jobs, 10.0)
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
        with caplog.at_level("WARNING", logger="celery_anarchon.scheduler"):
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


@pytest.mark.services
def test_misses_while_the_backend_is_away_are_recorded_once_it_is_back(
    own_redis: RedisServer,
) -> None:
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    app = make_app(url, 5, 10.0)
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
        assert sorted(name for name, *_ in s._unrecorded) == [f"job-{i:04d}" for i in range(5)]
        own_redis.start()
        clock.now = slot + 9  # past the reconnect backoff, before the next slot
        s.tick()
        assert list(s._unrecorded) == []
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


def test_a_job_late_twice_in_one_round_counts_each_missed_slot_once(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A backup claims 4 s after the slot; it stalls past max_late (5 s) of
    # that pending claim and of the job's next slot: one round holds two late
    # events of one job (review finding: the metric counted 4 for 2 slots).
    app = make_app(sqlite_url, 1, 10.0, anarchon_jitter=4)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    counted: list[tuple[str, int]] = []
    try:
        monkeypatch.setattr(s, "_claim_delay_ms", lambda job, slot_ms: 4000)
        monkeypatch.setattr(s.metrics, "missed", lambda job, n=1: counted.append((job, n)))
        s.tick()
        clock.now = slot + 0.1
        s.tick()  # the slot is due: its claim is planned 4 s later
        clock.now = slot + 16  # past max_late of the slot and of the next one
        with caplog.at_level("WARNING", logger="celery_anarchon.scheduler"):
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
