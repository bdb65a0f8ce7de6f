"""Publishing: what a sent slot carries, Celery's broker away or cut, bounded
connection attempts, and a claim's age checked right before its publish."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

import celery_anarchon.beat.publisher as publisher_module
from celery_anarchon.backends.base import State
from celery_anarchon.beat.agenda import CLAIM, Slot
from celery_anarchon.beat.publisher import PUBLISH_ATTEMPTS
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.message import task_id_for

from ..conftest import require_service
from ..faults.servers import Proxy, RedisServer
from .support import (
    BROKER_DB,
    Clock,
    CountingRefuser,
    SlowConnect,
    Unserializable,
    jobs_app,
    next_slot,
    queued_slots,
    redis_app,
    sent_messages,
    sent_slots,
    sqlite_app,
    tick_for,
)


def test_sends_each_due_slot_with_headers_and_derived_task_id(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=0.5)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        assert s.tick() == pytest.approx(0.5)  # first slot: t0 + 1
        assert sent_messages(app) == []
        clock.now = t0 + 1.0
        s.tick()
        [headers] = sent_messages(app)
        slot = int((t0 + 1) * 1000)
        assert headers["anarchon_job"] == "tick"
        assert headers["anarchon_slot"] == slot
        assert headers["anarchon_token"] == 1
        task_id = task_id_for("tick", slot, namespace=s.backend.namespace)  # type: ignore[union-attr]
        assert headers["id"] == task_id
        assert headers["task"] == "proj.tick"
        [record] = s.backend.history("tick")  # type: ignore[union-attr]
        assert (record.state, record.task_id) == (State.SENT, task_id)
    finally:
        s.close()


def test_two_projects_sharing_a_backend_send_different_task_ids_for_one_slot(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    """Two projects, each with a job ``tick``, on one backend under their
    own prefixes: one slot, two task ids (a shared result backend would
    otherwise mix their results); each instance of a project derives its
    project's id."""
    slot = int((t0 + 1) * 1000)
    ids = {}
    for project in ("shop", "blog"):
        app = sqlite_app(
            tmp_path,
            every_second,
            anarchon_max_late=0.5,
            anarchon_backend_options={"prefix": f"{project}_"},
            task_default_queue=f"q-{project}",
        )
        clock = Clock(t0 + 0.5)
        s = Scheduler(app, clock=clock)
        try:
            s.tick()
            clock.now = t0 + 1.0
            s.tick()
            [headers] = sent_messages(app)
            assert headers["anarchon_slot"] == slot
            ids[project] = headers["id"]
            assert ids[project] == task_id_for("tick", slot, namespace=f"{project}_")
        finally:
            s.close()
    assert ids["shop"] != ids["blog"]


def test_apply_entry_never_raises(t0: float, tmp_path: Path, every_second: dict[str, Any]) -> None:
    s = Scheduler(sqlite_app(tmp_path, every_second), clock=Clock(t0))
    try:
        s.apply_entry(s.schedule["tick"], producer=None)
    finally:
        s.close()


@pytest.mark.services
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
            assert tick_for(s, lambda: sent.extend(queued_slots(broker_queue)) or sent, 15)
            proxy.cut()
            with caplog.at_level(logging.ERROR, logger="celery_anarchon.beat"):
                assert tick_for(s, lambda: "sending failed" in caplog.text, 15)
            back_ms = int(time.time() * 1000)
            proxy.restore()
            after: list[int] = []
            assert tick_for(
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


@pytest.mark.services
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


@pytest.mark.services
def test_the_producer_connects_once_not_with_celerys_retries(refuser: CountingRefuser) -> None:
    app = Celery("p", set_as_current=False, broker=f"redis://127.0.0.1:{refuser.port}/0")
    app.conf.broker_connection_max_retries = 100
    s = Scheduler(app, lazy=True)
    with pytest.raises(Exception):  # noqa: B017  (kombu's OperationalError)
        s.producer  # noqa: B018
    assert refuser.count == 1


@pytest.mark.services
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


@pytest.mark.services
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


def test_an_ambiguous_publish_failure_is_not_published_again(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker receives the message, then the connection drops before
    # the publish returns (a socket error after the write). Beat cannot know
    # whether it arrived; docs/exactly-once.md: any doubt counts as lost, one
    # publish per slot except when an instance dies or freezes.
    app = jobs_app(sqlite_url, 1, 10.0)
    slot = next_slot(10.0)
    clock = Clock(slot - 0.5)
    s = Scheduler(app, clock=clock)
    real_send = publisher_module.send_slot
    calls: list[int] = []

    def delivered_then_dropped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        result = real_send(*args, **kwargs)
        if len(calls) == 1:
            raise ConnectionResetError("connection reset after the publish was written")
        return result

    try:
        monkeypatch.setattr(publisher_module, "send_slot", delivered_then_dropped)
        clock.now = slot + 0.1
        s.tick()
        slot_ms = int(slot * 1000)
        sent = sent_slots(app)
        assert s.backend is not None
        states = [r.state for r in s.backend.history("job-0000")]
        assert State.SUPERSEDED not in states  # no take-over on record
        assert sent == [("job-0000", slot_ms)], f"published {len(sent)} times: {sent}"
        assert states == [State.LOST]  # in doubt: recorded, not sent again
    finally:
        s.close()


@pytest.mark.services
def test_a_refused_connection_on_the_first_publish_after_a_broker_cut_is_left_to_a_backup(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, item 4: the first publish after Celery's broker went away
    reconnects inside the publish and is refused (``OperationalError('Error
    111 connecting ... Connection refused.')``). A connection that was never
    made delivered nothing: the slot is left to a backup (claimed, on its
    lease), as the later publishes with the same error are, not recorded
    ``lost`` as a publish that may have reached the broker."""
    require_service("redis")
    queue = f"refused-{uuid.uuid4().hex[:8]}"
    schedule = {name: {"task": "sp.run", "schedule": 3600.0} for name in ("before", "after")}
    app = redis_app(f"redis://127.0.0.1:{own_redis.port}/0", queue, schedule)
    now = float(int(time.time()))
    s = Scheduler(app, clock=Clock(now))
    try:
        s.agenda.push(int(now * 1000), Slot(s.jobs["before"], int(now * 1000), CLAIM))
        s.tick()
        backend = s.backend
        assert backend is not None
        assert [r.state for r in backend.history("before")] == [State.SENT]
        own_redis.crash()
        with caplog.at_level(logging.ERROR, logger="celery_anarchon.beat"):
            s.agenda.push(int(now * 1000), Slot(s.jobs["after"], int(now * 1000), CLAIM))
            s.tick()
        assert [r.state for r in backend.history("after")] == [State.CLAIMED], caplog.text
        assert "may have reached the broker" not in caplog.text
        assert "left for a backup" in caplog.text
    finally:
        s.close()


@pytest.mark.services
def test_args_the_serializer_refuses_fail_their_own_slot_only(
    broker_queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, item 1: kombu's ``EncodeError`` (a custom object under
    JSON) was taken for a broker outage, and every publish paused: the
    other jobs sent almost nothing. It is the slot's own failure: recorded
    ``lost`` with the serializer's error; the next slot in the same tick is
    sent."""
    schedule = {
        "nonjson": {"task": "sp.run", "schedule": 3600.0, "args": [Unserializable()]},
        "good": {"task": "sp.run", "schedule": 3600.0},
    }
    app = redis_app(f"redis://127.0.0.1:6379/{BROKER_DB}", broker_queue, schedule)
    now = float(int(time.time()))
    s = Scheduler(app, clock=Clock(now))
    try:
        with caplog.at_level(logging.ERROR, logger="celery_anarchon.beat"):
            for name in ("nonjson", "good"):
                s.agenda.push(int(now * 1000), Slot(s.jobs[name], int(now * 1000), CLAIM))
            s.tick()
        backend = s.backend
        assert backend is not None
        [bad] = backend.history("nonjson")
        [good] = backend.history("good")
        assert bad.state is State.LOST and "EncodeError" in (bad.error or ""), bad
        assert good.state is State.SENT, caplog.text
        assert queued_slots(broker_queue) == [int(now * 1000)]
        assert "not tried again yet" not in caplog.text
    finally:
        s.close()


@pytest.mark.services
def test_args_the_task_does_not_take_fail_their_own_slot_only(broker_queue: str) -> None:
    """Celery's argument check (``strict_typing``) raises ``TypeError``
    before anything is written: the slot's own failure, as a serializer's
    refusal is, never a pause of every publish."""
    schedule = {
        "extra-arg": {"task": "sp.none", "schedule": 3600.0, "args": [1]},
        "good": {"task": "sp.none", "schedule": 3600.0},
    }
    app = redis_app(f"redis://127.0.0.1:6379/{BROKER_DB}", broker_queue, schedule)

    @app.task(name="sp.none")
    def takes_nothing() -> None:
        """Takes no arguments."""

    now = float(int(time.time()))
    s = Scheduler(app, clock=Clock(now))
    try:
        for name in ("extra-arg", "good"):
            s.agenda.push(int(now * 1000), Slot(s.jobs[name], int(now * 1000), CLAIM))
        s.tick()
        backend = s.backend
        assert backend is not None
        [bad] = backend.history("extra-arg")
        [good] = backend.history("good")
        assert bad.state is State.LOST and "TypeError" in (bad.error or ""), bad
        assert good.state is State.SENT
        assert queued_slots(broker_queue) == [int(now * 1000)]
    finally:
        s.close()


def tick_once_declaring(app: Celery, t0: float) -> list[str | None]:
    """Start a scheduler on ``app`` half a second before ``t0 + 1`` and run
    the tick at ``t0 + 1``: the name of every entity kombu's
    ``Producer.maybe_declare`` was asked to declare, in order."""
    from kombu.messaging import Producer

    declared: list[str | None] = []
    original = Producer.maybe_declare

    def spy(self: Any, entity: Any, *args: Any, **kwargs: Any) -> Any:
        declared.append(getattr(entity, "name", None))
        return original(self, entity, *args, **kwargs)

    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Producer, "maybe_declare", spy)
            clock.now = t0 + 1.0
            s.tick()
    finally:
        s.close()
    return declared


def test_message_by_message_a_route_is_declared_once_per_connection(
    t0: float, tmp_path: Path
) -> None:
    """Off the batch path (here the in-memory transport) the first message
    of a route declares its queue and the others of that connection do not:
    Celery's ``maybe_declare`` before every publish copies and binds the
    queue each time. The messages are the same."""
    schedule = {f"j{i}": {"task": "proj.j", "schedule": 1.0} for i in range(5)}
    app = sqlite_app(tmp_path, schedule, anarchon_max_late=0.5)
    declared = tick_once_declaring(app, t0)
    assert sorted(h["anarchon_job"] for h in sent_messages(app)) == [f"j{i}" for i in range(5)]
    assert declared == [app.conf.task_default_queue]


@pytest.mark.parametrize("case", ["task's auto-delete queue", "entry's own declare"])
def test_a_queue_the_task_or_entry_routes_to_is_declared_as_celery_would(
    t0: float, tmp_path: Path, case: str
) -> None:
    """Declare-once reads the route ``apply_async`` takes: a task's own
    ``queue`` that is auto-delete (the broker drops it when its consumer
    leaves) is declared before every message, and an entry's own
    ``declare`` list is never replaced."""
    from kombu import Queue

    options: dict[str, Any] = {}
    if case == "entry's own declare":
        options = {"declare": [Queue("aux")]}
    schedule = {
        f"j{i}": {"task": "proj.eph", "schedule": 1.0, "options": options} for i in range(3)
    }
    app = sqlite_app(tmp_path, schedule, anarchon_max_late=0.5)
    app.conf.task_queues = [Queue(app.conf.task_default_queue), Queue("eph", auto_delete=True)]

    @app.task(
        name="proj.eph", queue="eph" if case == "task's auto-delete queue" else None, shared=False
    )
    def eph() -> None:
        """A task."""

    want = "eph" if case == "task's auto-delete queue" else "aux"
    assert tick_once_declaring(app, t0) == [want] * 3
