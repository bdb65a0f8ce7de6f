"""The scheduler's publish path and the paths that end in a publish or a
record: a broker connection cut and restored, bounded publishing, a claim
gone stale before its publish, hand-over on shutdown, catch-up after the
backend was down at start-up, catch-up against ``overlap='skip'``.

Real services: Redis (claims and Celery's broker, through the fault
harness's TCP proxy where a fault is needed), kombu's ``memory://`` broker
where only the scheduler's decisions matter, real ``celery beat`` processes
for the shutdown hand-over.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue

from celery_anarchon.backends.base import State
from celery_anarchon.beat.agenda import CLAIM, Slot
from celery_anarchon.beat.publisher import PUBLISH_ATTEMPTS
from celery_anarchon.beat.scheduler import Scheduler

from .beat.support import SEND_DELAY
from .conftest import REDIS_URL, require_service
from .faults.servers import Proxy

pytestmark = pytest.mark.services

BROKER_DB = 1  # Celery's broker on the shared Redis (db 0 holds claims)


class Clock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def redis_app(broker: str, queue: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    """An app as the fault campaign's: Redis claims under a unique prefix,
    Celery's broker at ``broker``, tasks routed by a named direct exchange
    to ``queue`` (the path on which a closed channel shows)."""
    exchange = Exchange(queue, type="direct")
    app = Celery(f"send-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        task_queues=[Queue(queue, exchange, routing_key=queue)],
        task_default_queue=queue,
        task_routes={"sp.*": {"exchange": queue, "routing_key": queue}},
        anarchon_backend=REDIS_URL,
        anarchon_backend_options={"prefix": f"anarchon-send:{uuid.uuid4().hex[:8]}:"},
        anarchon_jitter=0,
        anarchon_max_late=5,
        anarchon_lease_ttl=2,
        beat_schedule=schedule,
        timezone="UTC",
        **conf,
    )
    return app


@pytest.fixture
def broker_queue() -> Iterator[str]:
    """A queue on the Redis broker, declared (so publishes are routed to it)
    and removed with its binding tables afterwards."""
    require_service("redis")
    name = f"send-path-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:6379/{BROKER_DB}"
    with Connection(url) as conn:
        Queue(name, Exchange(name, type="direct"), routing_key=name).bind(
            conn.default_channel
        ).declare()
    yield name
    client = redis.Redis(db=BROKER_DB)
    client.delete(name, f"_kombu.binding.{name}", f"_kombu.binding_permanent.{name}")
    client.close()


def queued_slots(queue: str) -> list[int]:
    """``anarchon_slot`` of every message on ``queue`` (taken off)."""
    found = []
    with Connection(f"redis://127.0.0.1:6379/{BROKER_DB}") as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(timeout=0.2)
                except simple.Empty:
                    break
                found.append(int(message.headers["anarchon_slot"]))
        finally:
            simple.close()
    return found


def tick_until(s: Scheduler, check: Any, timeout: float) -> bool:
    """Tick ``s`` on the real clock until ``check()`` is true (``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.tick()
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


# -- (a) a broker connection cut and restored -----------------------------------


def test_sends_again_once_a_cut_broker_connection_is_back(
    broker_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 7, "broker outage" on Redis: after a cut, kombu closes the
    cached producer's channel and cannot revive it while the broker is away;
    beat then failed every later publish with ``AttributeError: 'NoneType'
    object has no attribute 'state'`` for as long as it ran. Now the
    producer and its connection are made afresh after a failure."""
    with Proxy(6379) as proxy:
        app = redis_app(
            f"redis://127.0.0.1:{proxy.port}/{BROKER_DB}",
            broker_queue,
            {"sp": {"task": "sp.run", "schedule": 1.0}},
        )
        s = Scheduler(app)
        try:
            sent: list[int] = []
            assert tick_until(s, lambda: sent.extend(queued_slots(broker_queue)) or sent, 15)
            proxy.cut()
            with caplog.at_level(logging.ERROR, logger="celery_anarchon.beat"):
                assert tick_until(s, lambda: "sending failed" in caplog.text, 15)
            back_ms = int(time.time() * 1000)
            proxy.restore()
            after: list[int] = []
            assert tick_until(
                s,
                lambda: after.extend(queued_slots(broker_queue)) or len(after) >= 3,
                15,
            ), caplog.text
        finally:
            s.close()
    assert "no attribute 'state'" not in caplog.text
    assert [slot for slot in after if slot > back_ms], after
    backend = s.backend
    assert backend is not None
    backend.open()
    try:
        states = {r.slot_ms: r.state for r in backend.history("sp")}
    finally:
        backend.close()
    assert all(states.get(slot) is State.SENT for slot in after), (after, states)


# -- (b) bounded publishing --------------------------------------------------------


class CountingRefuser:
    """A TCP port that accepts each connection and closes it at once (a
    broker that is away), counting the connections."""

    def __init__(self) -> None:
        self.count = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._listener.close()


@pytest.fixture
def refuser() -> Iterator[CountingRefuser]:
    server = CountingRefuser()
    yield server
    server.close()


def test_a_broker_that_is_away_costs_a_tick_few_connection_attempts(
    refuser: CountingRefuser, caplog: pytest.LogCaptureFixture
) -> None:
    """Celery's beat connects with ``broker_connection_max_retries`` (100)
    retries and growing pauses: a tick blocked for many minutes. Here a
    tick with five won slots tries the broker at most PUBLISH_ATTEMPTS
    times, and leaves every slot to a backup, each on the record."""
    require_service("redis")
    schedule = {f"j{i}": {"task": "sp.run", "schedule": 3600.0} for i in range(5)}
    app = redis_app(f"redis://127.0.0.1:{refuser.port}/0", "unused", schedule)
    now = float(int(time.time()))
    s = Scheduler(app, clock=Clock(now))
    try:
        with caplog.at_level(logging.ERROR, logger="celery_anarchon.beat"):
            for name in schedule:
                s.agenda.push(int(now * 1000), Slot(s.jobs[name], int(now * 1000), CLAIM))
            s.tick()
        assert 1 <= refuser.count <= PUBLISH_ATTEMPTS
        assert caplog.text.count("sending failed") == len(schedule)
        backend = s.backend
        assert backend is not None
        for name in schedule:
            [record] = backend.history(name)
            assert record.state is State.CLAIMED  # left for a backup's take-over
    finally:
        s.close()


def test_the_producer_connects_once_not_with_celerys_retries(refuser: CountingRefuser) -> None:
    app = Celery("p", set_as_current=False, broker=f"redis://127.0.0.1:{refuser.port}/0")
    app.conf.broker_connection_max_retries = 100
    s = Scheduler(app, lazy=True)
    with pytest.raises(Exception):  # noqa: B017  (kombu's OperationalError)
        s.producer  # noqa: B018
    assert refuser.count == 1


def test_redis_broker_connection_gets_timeouts_unless_configured() -> None:
    app = Celery("p", set_as_current=False, broker="redis://127.0.0.1:6379/1")
    app.conf.broker_connection_timeout = 3.0
    s = Scheduler(app, lazy=True)
    options = s.connection.transport_options
    assert options["socket_connect_timeout"] == 3.0
    assert options["socket_timeout"] == 3.0
    app2 = Celery("p2", set_as_current=False, broker="redis://127.0.0.1:6379/1")
    app2.conf.broker_transport_options = {"socket_timeout": 30}
    s2 = Scheduler(app2, lazy=True)
    assert s2.connection.transport_options["socket_timeout"] == 30
    assert s2.connection.transport_options["socket_connect_timeout"] == 4.0


class SlowConnect(Scheduler):
    """A scheduler whose broker connect takes ``connect_s`` of its clock."""

    connect_s = 0.0

    def _ensure_connected(self) -> Any:
        self._clock.now += self.connect_s  # type: ignore[attr-defined]
        return super()._ensure_connected()


@pytest.mark.parametrize(("connect_s", "published"), [(1.0, True), (9.0, False)])
def test_the_claims_age_is_checked_again_right_before_the_publish(
    tmp_path: Path, connect_s: float, published: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim fresh when its send began but held more than 80 % of its
    lease (10 s) once the broker connection is up is not published: a
    backup may be taking it over."""
    now = float(int(time.time()))
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = Celery(f"slow-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=queue,
        anarchon_backend=f"sqlite:///{tmp_path / 'claims.db'}",
        anarchon_jitter=0,
        anarchon_max_skew=60,
        anarchon_lease_ttl=10,
        beat_schedule={"h": {"task": "t.h", "schedule": 3600.0}},
        timezone="UTC",
    )
    s = SlowConnect(app, clock=Clock(now))
    s.connect_s = connect_s
    try:
        s.agenda.push(int(now * 1000), Slot(s.jobs["h"], int(now * 1000), CLAIM))
        with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
            s.tick()
        with Connection("memory://") as conn:
            simple = conn.SimpleQueue(queue, no_ack=True)
            try:
                simple.get(timeout=0.1)
                got = True
            except simple.Empty:
                got = False
            simple.close()
        assert got is published
        backend = s.backend
        assert backend is not None
        [record] = backend.history("h")
        assert record.state is (State.SENT if published else State.CLAIMED)
        assert ("when its publish was due" in caplog.text) is not published
    finally:
        s.close()


# -- (d) catch-up when the backend is away at start-up ----------------------------


def record_finished(backend: Any, job: str, slot_ms: int, state: State = State.SENT) -> None:
    """A run of ``job`` at ``slot_ms`` that an earlier instance sent (and,
    with ``state`` SUCCEEDED, that a worker finished)."""
    from celery_anarchon.backends.base import ClaimRequest

    claim = backend.claim([ClaimRequest(job, slot_ms, 10**9, 10_000, slot_ms + 3_600_000)])[0]
    assert claim.won
    backend.mark(claim, State.SENT, task_id=f"old-{slot_ms}")
    if state is not State.SENT:
        backend.mark(claim, State.RUNNING)
        backend.mark(claim, state)


def memory_app(backend_url: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery(f"mem-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        task_default_queue=f"q-{uuid.uuid4().hex[:8]}",
        anarchon_backend=backend_url,
        anarchon_backend_options={"prefix": f"anarchon-send:{uuid.uuid4().hex[:8]}:"},
        anarchon_jitter=0,
        beat_schedule=schedule,
        timezone="UTC",
        **conf,
    )
    return app


def memory_sent(app: Celery) -> list[tuple[str, int]]:
    """``(job, slot)`` of every message on the app's queue, in queue order."""
    out = []
    with Connection("memory://") as conn:
        simple = conn.SimpleQueue(app.conf.task_default_queue, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(timeout=0.05)
                except simple.Empty:
                    break
                out.append((message.headers["anarchon_job"], int(message.headers["anarchon_slot"])))
        finally:
            simple.close()
    return out


def open_backend(app: Celery, instance: str) -> Any:
    from celery_anarchon.backends import backend_from_url

    conf = app.conf
    backend = backend_from_url(
        conf.anarchon_backend, instance=instance, options=dict(conf.anarchon_backend_options)
    )
    backend.open()
    return backend


def test_the_gap_is_settled_once_a_backend_down_at_start_up_answers(tmp_path: Path) -> None:
    """Every instance was down; the one that restarts finds the backend down
    too. Once the backend answers, the slots since its last record are
    recorded missed (``catch_up='none'``) or caught up (``'all'``), as at a
    start with the backend up; they used to be left unrecorded."""
    from .faults.servers import RedisServer

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
        app = memory_app(f"redis://127.0.0.1:{server.port}/0", schedule)
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
            assert tick_until(s, lambda: not s.agenda.unsettled, 30)
            tick_until(s, lambda: False, 1.5)  # the catch-up sends
            backend = s.backend
            assert backend is not None
            gap = [(restart - 730 + 60 * i) * 1000 for i in range(12)]  # 09:40 .. 09:51
            none_states = {r.slot_ms: r.state for r in backend.history("none")}
            assert all(none_states.get(slot) is State.MISSED for slot in gap), none_states
            all_states = {r.slot_ms: r.state for r in backend.history("all")}
            assert all(all_states.get(slot) is State.MISSED for slot in gap[:-3]), all_states
            sent = [slot for job, slot in memory_sent(app) if job == "all"]
            assert sent[:3] == gap[-3:]  # the newest three, oldest first
            assert all(all_states.get(slot) is State.SENT for slot in gap[-3:]), all_states
        finally:
            s.close()
    finally:
        server.crash()


# -- (e) catch-up respects overlap='skip' -----------------------------------------


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
    app = memory_app(REDIS_URL, schedule)
    before = open_backend(app, "before")
    record_finished(before, "once", (restart - 790) * 1000, State.SUCCEEDED)
    before.close()
    s = Scheduler(app, clock=Clock(float(restart)))
    try:
        s.tick()
        caught_up = [(restart - 310 + 60 * i) * 1000 for i in range(5)]  # 09:47 .. 09:51
        first = (restart - 10) * 1000  # 09:52, the first regular slot
        assert [slot for _, slot in memory_sent(app)] == caught_up[:1]
        backend = s.backend
        assert backend is not None
        states = {r.slot_ms: r.state for r in backend.history("once")}
        assert states[caught_up[0]] is State.SENT
        assert [states.get(slot) for slot in [*caught_up[1:], first]] == [State.SKIPPED] * 5
    finally:
        s.close()


# -- (c) hand-over on shutdown -------------------------------------------------------


def hourly_at(slot_s: int, **options: Any) -> dict[str, Any]:
    """One hourly job ``h`` whose slot falls at ``slot_s`` (epoch seconds)."""
    return {"h": {"task": "t.h", "schedule": 3600.0, "anarchon": {"anchor": slot_s, **options}}}


def test_a_backup_takes_a_handed_over_slot_whose_lease_outlives_max_late() -> None:
    """With ``lease_ttl`` (30 s) beyond ``max_late`` (20 s) a loser planned
    no take-over at all, so a slot its owner released on shutdown was
    sent by nobody and, released, had no record. Now the loser remembers
    the slot and checks it as soon as the owner leaves the registry."""
    require_service("redis")
    now = int(time.time())
    slot_s = now + 2
    app = memory_app(REDIS_URL, hourly_at(slot_s), anarchon_lease_ttl=30, anarchon_max_late=20)
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
        assert memory_sent(app) == []
        clock.now = slot_s + 1
        a.close()  # hands the slot over
        clock.now = slot_s + 6  # b's next heartbeat: a has left
        b.tick()
        assert memory_sent(app) == [("h", slot_s * 1000)]
        [record] = [r for r in b.backend.history("h") if r.slot_ms == slot_s * 1000]
        assert (record.state, record.instance) == (State.SENT, b.instance_id)
    finally:
        a.close()
        b.close()


def test_a_held_slot_too_late_to_hand_over_is_recorded_lost() -> None:
    require_service("redis")
    now = int(time.time())
    slot_s = now - 15
    app = memory_app(REDIS_URL, hourly_at(slot_s), anarchon_lease_ttl=30, anarchon_max_late=20)
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


def test_a_failed_send_no_backup_can_take_over_is_recorded_lost_on_shutdown(
    refuser: CountingRefuser,
) -> None:
    """A send failed (broker away); its lease (30 s) ends after ``max_late``
    (20 s), so no backup can take it over. Its ``lost`` record was due at
    ``max_late``, from this instance: on shutdown before that it is written
    at once, with the reason."""
    require_service("redis")
    now = int(time.time())
    app = memory_app(REDIS_URL, hourly_at(now), anarchon_lease_ttl=30, anarchon_max_late=20)
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


def test_a_closed_scheduler_never_ticks_on(tmp_path: Path) -> None:
    """Beat closes the scheduler in its SIGTERM handler and raises
    SystemExit wherever the main thread is; redis-py reading the socket
    close() had shut turned it into ``ValueError: I/O operation on closed
    file``, which a tick survived: the beat reconnected and kept sending
    after its hand-over until killed (seen in a real beat, 1 in 16 stops
    under load). A tick after close() now exits."""
    app = memory_app(f"sqlite:///{tmp_path / 'claims.db'}", hourly_at(int(time.time())))
    app.conf.anarchon_backend_options = {}
    s = Scheduler(app)
    s.tick()
    s.close()
    with pytest.raises(SystemExit):
        s.tick()
    assert memory_sent(app) == [
        ("h", int(app.conf.beat_schedule["h"]["anarchon"]["anchor"]) * 1000)
    ]


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
    from celery_anarchon.beat.registry import HEARTBEAT_INTERVAL

    from .beats import instance_prefix
    from .faults.harness import MISS_STATES, FaultRun, wait_until

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
        assert run.cluster.wait_ticking([victim]), run.cluster.logs()
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
    app = memory_app(f"sqlite:///{tmp_path / 'claims.db'}", hourly_at(int(time.time())))
    app.conf.anarchon_backend_options = {}
    s = Scheduler(app)
    backend = s.backend
    seen: list[tuple[bool, bool]] = []

    def closing_pop_due(now_ms: int) -> list[Slot]:  # the signal handler comes mid-tick
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
