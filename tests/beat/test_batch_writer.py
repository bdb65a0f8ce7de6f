"""The batched send path (issue 14) on real brokers: Redis pipelines and
AMQP publisher confirms, what each message became, and that the messages
are Celery's own.

Faults a real broker cannot be made to show on demand (a pipeline or a
confirm that never comes back) are made with the test's own TCP proxy
(tests/faults/servers.Proxy) stalling the replies.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Connection, Queue

from celery_anarchon.backends.base import State
from celery_anarchon.beat.batch import BatchWriter, Outcome
from celery_anarchon.message import send_slot

from ..conftest import require_service
from ..faults.harness import FaultRun
from ..faults.servers import Proxy

pytestmark = pytest.mark.services

REDIS = "redis://127.0.0.1:6379/1"
AMQP = "amqp://guest:guest@127.0.0.1:5672//"


class Unserializable:
    """Args json refuses."""


def app_for(broker: str, queue: str | None = None, **conf: Any) -> Celery:
    app = Celery(f"bw-{uuid.uuid4().hex[:6]}", set_as_current=False, broker=broker)
    queue = queue or f"bw-{uuid.uuid4().hex[:8]}"
    app.conf.update(task_default_queue=queue, timezone="UTC", **conf)
    return app


def publisher(app: Celery) -> Any:
    """The writer's publish: item ``i`` is task ``bw.t`` with args ``[i]``
    (an unserializable arg where ``i`` is negative)."""

    def publish(item: int, producer: Any) -> None:
        args = [Unserializable()] if item < 0 else [item]
        app.send_task("bw.t", args, producer=producer, task_id=f"id-{item}")

    return publish


def queued(app: Celery, delete: bool = False) -> list[dict[str, Any]]:
    """Every message on the app's default queue, taken off it (raw
    payloads: body decoded, headers, properties); ``delete``: and the queue
    deleted."""
    out = []
    with Connection(app.conf.broker_url) as conn:
        queue = Queue(app.conf.task_default_queue).bind(conn.default_channel)
        try:
            while (message := queue.get(no_ack=True)) is not None:
                out.append(
                    {
                        "body": message.decode(),
                        "headers": dict(message.headers),
                        "properties": dict(message.properties),
                    }
                )
        except Exception:  # the queue was never declared
            return out
        if delete:
            queue.delete()
    return out


@pytest.fixture
def redis_app() -> Iterator[Celery]:
    require_service("redis")
    app = app_for(REDIS)
    yield app
    queued(app, delete=True)


@pytest.fixture
def confirm_app() -> Iterator[Celery]:
    require_service("rabbitmq")
    app = app_for(AMQP, broker_transport_options={"confirm_publish": True})
    yield app
    queued(app, delete=True)


def counts(outcomes: list[tuple[Outcome, BaseException | None]]) -> Counter[Outcome]:
    return Counter(outcome for outcome, _ in outcomes)


@pytest.mark.parametrize("fixture", ["redis_app", "confirm_app"])
def test_every_message_is_written_and_a_refused_one_alone_is_left_out(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    app: Celery = request.getfixturevalue(fixture)
    items = list(range(1200))
    items[700] = -1
    with app.producer_or_acquire() as producer:
        writer = BatchWriter(publisher(app), flush_every=500)
        outcomes = writer.write(producer, items, lambda index: True)
    assert counts(outcomes) == {Outcome.SENT: 1199, Outcome.REFUSED: 1}
    outcome, error = outcomes[700]
    assert outcome is Outcome.REFUSED and "not JSON serializable" in repr(error)
    bodies = sorted(m["body"][0][0] for m in queued(app))
    assert bodies == [i for i in items if i >= 0]
    assert not writer.broken


def test_the_mode_follows_the_transport() -> None:
    assert BatchWriter.mode(Connection(REDIS)) == "pipeline"
    assert BatchWriter.mode(Connection(AMQP)) is None  # basic_publish does not wait
    confirms = Connection(AMQP, transport_options={"confirm_publish": True})
    assert BatchWriter.mode(confirms) == "confirms"
    assert BatchWriter.mode(Connection("memory://")) is None
    retrying = Connection(REDIS, transport_options={"retry_on_timeout": True})
    assert BatchWriter.mode(retrying) is None  # kombu would replay a pipeline


def test_redis_writes_one_pipeline_per_chunk(redis_app: Celery) -> None:
    """1,200 messages in chunks of 500 are three writes: the pipeline's
    ``execute`` is called three times, not once per message."""
    from redis.client import Pipeline

    calls = []
    original = Pipeline.execute

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        pushes = sum(1 for args, _ in self.command_stack if args[0] == "LPUSH")
        if pushes:  # not kombu's own reads (queue declares, bindings)
            calls.append(pushes)
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, redis_app.producer_or_acquire() as producer:
        patch.setattr(Pipeline, "execute", execute)
        outcomes = BatchWriter(publisher(redis_app), flush_every=500).write(
            producer, list(range(1200)), lambda index: True
        )
    assert counts(outcomes) == {Outcome.SENT: 1200}
    assert calls == [500, 500, 200]


@pytest.mark.parametrize("fixture", ["redis_app", "confirm_app"])
def test_keep_going_stops_and_may_write_discards(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    app: Celery = request.getfixturevalue(fixture)
    with app.producer_or_acquire() as producer:
        writer = BatchWriter(publisher(app), flush_every=100)
        outcomes = writer.write(producer, list(range(300)), lambda index: index < 150)
        assert counts(outcomes) == {Outcome.SENT: 150, Outcome.UNTRIED: 150}
        assert [o for o, _ in outcomes[:150]] == [Outcome.SENT] * 150
        assert len(queued(app)) == 150
        asked: list[list[int]] = []

        def may_write(indexes: Any) -> bool:
            asked.append(list(indexes))
            return len(asked) == 1  # the second write is given up

        outcomes = writer.write(producer, list(range(300)), lambda index: True, may_write)
    assert counts(outcomes) == {Outcome.SENT: 100, Outcome.UNTRIED: 200}
    assert asked[0] == list(range(100)) and asked[1] == list(range(100, 200))
    assert sorted(m["body"][0][0] for m in queued(app)) == list(range(100))


def test_an_unanswered_redis_pipeline_puts_its_chunk_in_doubt(redis_app: Celery) -> None:
    """The Redis server stops answering while a chunk is written: that
    chunk is in doubt (it may be queued), the chunks after it are not
    tried, and the writer says its producer is broken."""
    with Proxy(6379) as proxy:
        app = app_for(
            f"redis://127.0.0.1:{proxy.port}/1",
            broker_transport_options={"socket_timeout": 1.0},
            queue=redis_app.conf.task_default_queue,
        )
        with app.producer_or_acquire() as producer:
            writer = BatchWriter(publisher(app), flush_every=100)

            def keep_going(index: int) -> bool:
                if index == 150:
                    proxy.stall()  # the second chunk's write is not answered
                return True

            started = time.monotonic()
            outcomes = writer.write(producer, list(range(300)), keep_going)
            took = time.monotonic() - started
        proxy.unstall()
    assert [o for o, _ in outcomes[:100]] == [Outcome.SENT] * 100
    assert [o for o, _ in outcomes[100:200]] == [Outcome.IN_DOUBT] * 100
    assert [o for o, _ in outcomes[200:]] == [Outcome.UNTRIED] * 100
    assert "BatchPublishError" in repr(outcomes[150][1])
    assert writer.broken
    assert took < 10
    # The in-doubt chunk did reach Redis (the proxy held only the reply):
    # exactly why it must never be sent again.
    assert len(queued(redis_app)) == 200


def test_unconfirmed_amqp_messages_are_in_doubt(confirm_app: Celery) -> None:
    with Proxy(5672) as proxy:
        app = app_for(
            f"amqp://guest:guest@127.0.0.1:{proxy.port}//",
            broker_transport_options={"confirm_publish": True},
            queue=confirm_app.conf.task_default_queue,
        )
        with app.producer_or_acquire() as producer:
            writer = BatchWriter(publisher(app), flush_every=100, confirm_timeout=1.0)
            first = writer.write(producer, list(range(100)), lambda index: True)
            proxy.stall()  # the confirms of what follows never come back
            second = writer.write(producer, list(range(100, 200)), lambda index: True)
        proxy.unstall()
    assert counts(first) == {Outcome.SENT: 100}
    assert counts(second) == {Outcome.IN_DOUBT: 100}
    assert "confirm" in repr(second[0][1])
    assert writer.broken


def test_nacked_amqp_messages_are_in_doubt(confirm_app: Celery) -> None:
    """A queue that rejects publishes once full (``x-overflow:
    reject-publish``) makes RabbitMQ nack them: those are in doubt, the
    confirmed ones sent."""
    name = confirm_app.conf.task_default_queue
    arguments = {"x-max-length": 50, "x-overflow": "reject-publish"}
    confirm_app.conf.task_queues = [Queue(name, queue_arguments=arguments)]
    with confirm_app.producer_or_acquire() as producer:
        outcomes = BatchWriter(publisher(confirm_app), flush_every=100).write(
            producer, list(range(80)), lambda index: True
        )
    assert counts(outcomes) == {Outcome.SENT: 50, Outcome.IN_DOUBT: 30}
    assert [o for o, _ in outcomes[:50]] == [Outcome.SENT] * 50
    assert "nacked" in repr(outcomes[60][1])


def test_a_batch_message_is_the_message_apply_async_sends(redis_app: Celery) -> None:
    """The same slot, once through the batch path and once through a plain
    ``apply_async``: the same body, headers and properties, delivery tags
    aside; Celery's publish signals fire for each."""
    from celery import beat

    entry = beat.ScheduleEntry(
        name="nightly",
        task="bw.report",
        schedule=60.0,
        args=(1, "two"),
        kwargs={"three": 3.0},
        options={"priority": 3, "headers": {"team": "ops"}},
        app=redis_app,
    )
    fired: list[tuple[str, str]] = []

    def before(sender: Any, headers: Any, **kwargs: Any) -> None:
        fired.append(("before", headers["id"]))

    def after(sender: Any, headers: Any, **kwargs: Any) -> None:
        fired.append(("after", headers["id"]))

    def send(item: int, producer: Any) -> None:
        send_slot(
            redis_app,
            entry,
            job="nightly",
            slot_ms=1_800_000_000_000,
            token=7,
            task_id="the-id",
            producer=producer,
            retry=False,
        )

    signals.before_task_publish.connect(before, weak=False)
    signals.after_task_publish.connect(after, weak=False)
    try:
        with redis_app.producer_or_acquire() as producer:
            send(0, producer)  # apply_async, one write
            outcomes = BatchWriter(send).write(producer, [0], lambda index: True)
    finally:
        signals.before_task_publish.disconnect(before)
        signals.after_task_publish.disconnect(after)
    assert counts(outcomes) == {Outcome.SENT: 1}
    assert fired == [("before", "the-id"), ("after", "the-id")] * 2
    plain, batched = queued(redis_app)
    for message in (plain, batched):
        message["properties"].pop("delivery_tag")
    assert batched == plain
    assert plain["headers"]["anarchon_slot"] == 1_800_000_000_000
    assert plain["headers"]["team"] == "ops"


def test_a_real_worker_runs_what_beats_sent_in_batches(tmp_path: Path) -> None:
    """Three real beats on Redis (claims and broker) send 300 jobs due
    together in batches; a real worker runs each slot once."""
    require_service("redis")
    schedules: dict[str, Any] = {f"j{i:03d}": 5.0 for i in range(300)}
    with FaultRun("redis", tmp_path, schedules=schedules) as run:
        run.start(3)
        time.sleep(14)
        run.stop()
        outcome = run.outcome()
    logs = run.cluster.logs()
    assert len(outcome.due) >= 300, logs  # the slots due while all three ran
    assert outcome.duplicate_publishes() == {}, logs
    assert outcome.duplicate_executions() == {}, logs
    assert outcome.missed() == [], logs


def test_a_refused_message_is_its_slots_loss_alone(redis_app: Celery) -> None:
    """In one batch, a job whose args json refuses is recorded lost with
    the serializer's error; the other jobs of the batch are sent and the
    publisher is not paused."""
    from celery_anarchon.beat.agenda import CLAIM, Slot
    from celery_anarchon.beat.scheduler import Scheduler
    from tests.beat.support import Clock

    schedule: dict[str, Any] = {f"good{i}": {"task": "bw.t", "schedule": 3600.0} for i in range(20)}
    schedule["bad"] = {"task": "bw.t", "schedule": 3600.0, "args": [Unserializable()]}
    redis_app.conf.update(
        beat_schedule=schedule,
        anarchon_backend="redis://127.0.0.1:6379/2",
        anarchon_backend_options={"prefix": f"anarchon-bw:{uuid.uuid4().hex[:8]}:"},
        anarchon_jitter=0,
        anarchon_max_skew=60,
    )
    now = float(int(time.time()))
    s = Scheduler(redis_app, clock=Clock(now))
    try:
        for name in schedule:
            s.agenda.push(int(now * 1000), Slot(s.jobs[name], int(now * 1000), CLAIM))
        s.tick()
        s.journal.flush_marks()
        backend = s.backend
        assert backend is not None
        states = {name: backend.history(name)[0] for name in schedule}
        assert s.publisher._paused_until == 0.0
    finally:
        s.close()
    assert {n: r.state for n, r in states.items() if n != "bad"} == {
        f"good{i}": State.SENT for i in range(20)
    }
    assert states["bad"].state is State.LOST
    assert "not JSON serializable" in (states["bad"].error or "")
    assert sorted(m["headers"]["anarchon_job"] for m in queued(redis_app)) == sorted(
        f"good{i}" for i in range(20)
    )


def test_a_redis_chunk_to_an_expiring_queue_is_one_write(redis_app: Celery) -> None:
    """A queue with an expiry costs kombu five pipeline commands per
    message (an LPUSH and a PEXPIRE per priority step), more than the
    chunk's pipeline was sized for: kombu must still not write part of the
    chunk on its own while a message is buffered. Were it to, and that
    write go unanswered, the message being buffered would be called 'not
    sent' although it was in the write, and the caller would send it a
    second time."""
    name = redis_app.conf.task_default_queue
    with Proxy(6379) as proxy:
        app = app_for(
            f"redis://127.0.0.1:{proxy.port}/1",
            broker_transport_options={"socket_timeout": 1.0},
            queue=name,
            task_queues=[Queue(name, expires=60)],
        )
        with app.producer_or_acquire() as producer:
            writer = BatchWriter(publisher(app), flush_every=16)

            def keep_going(index: int) -> bool:
                if index == 15:
                    proxy.stall()  # from the last message on, nothing answered
                return True

            outcomes = writer.write(producer, list(range(16)), keep_going)
        proxy.unstall()
    written = {m["body"][0][0] for m in queued(redis_app)}
    not_sent = {i for i, (outcome, _) in enumerate(outcomes) if outcome is Outcome.NOT_SENT}
    assert not (written & not_sent), f"'not sent' yet queued: {sorted(written & not_sent)}"
    assert [o for o, _ in outcomes] == [Outcome.IN_DOUBT] * 16
    assert writer.broken


def test_a_redis_chunk_is_one_write_however_many_commands_a_message_takes(
    redis_app: Celery,
) -> None:
    """100 messages to an expiring queue (five pipeline commands each) are
    one pipeline: a chunk that fails is in doubt as a whole, and one that
    was written is sent as a whole (never some of it written, then called
    in doubt and recorded lost though queued)."""
    from redis.client import Pipeline

    calls = []
    original = Pipeline.execute

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        pushes = sum(1 for args, _ in self.command_stack if args[0] == "LPUSH")
        if pushes:
            calls.append(pushes)
        return original(self, *args, **kwargs)

    name = redis_app.conf.task_default_queue
    app = app_for(REDIS, queue=name, task_queues=[Queue(name, expires=60)])
    with pytest.MonkeyPatch.context() as patch, app.producer_or_acquire() as producer:
        patch.setattr(Pipeline, "execute", execute)
        outcomes = BatchWriter(publisher(app), flush_every=100).write(
            producer, list(range(100)), lambda index: True
        )
    assert counts(outcomes) == {Outcome.SENT: 100}
    assert calls == [100]


def test_a_queue_the_broker_may_drop_is_declared_before_every_message() -> None:
    """The declare-once shortcut of the batch path holds only for a queue
    kombu itself declares once: not one that expires or is deleted when
    unused, nor under task_routes (a router may choose by args)."""
    from kombu import Queue

    from celery_anarchon.beat.publisher import Publisher

    app = app_for(REDIS)
    app.conf.task_queues = [
        Queue(app.conf.task_default_queue),
        Queue("expiring", expires=30),
        Queue("transient", auto_delete=True),
    ]
    publisher = Publisher.__new__(Publisher)
    publisher._app = app
    assert publisher._declaration_cached(None)
    assert publisher._declaration_cached(app.conf.task_default_queue)
    assert not publisher._declaration_cached("expiring")
    assert not publisher._declaration_cached("transient")
    assert not publisher._declaration_cached(Queue("q", queue_arguments={"x-expires": 1000}))
