"""The releaser in one process, against real Redis/PostgreSQL stores and a
real Redis broker (or none listening): what it publishes, what it gives
back, and that the backend's push wakes it."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_anarchon import delayed
from celery_anarchon.delayed.model import Parked, encode_payload
from celery_anarchon.delayed.releaser import Releaser, backoff_s
from celery_anarchon.delayed.settings import DelayedSettings

from .beats import read_queue
from .conftest import MYSQL_URL, POSTGRES_URL, require_service
from .test_delayed import STORES, make_app, store_fixtures, store_url

BROKER = "redis://127.0.0.1:6379/1"


@pytest.fixture(params=STORES)
def url(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    require_service("redis")
    store_fixtures(request, name)
    return store_url(name, uuid.uuid4().hex[:6])


@pytest.fixture
def made() -> Iterator[list[Any]]:
    """Releasers and apps to close at the end."""
    things: list[Any] = []
    yield things
    for thing in things:
        if isinstance(thing, Releaser):
            thing.stop()
        else:
            delayed.store_for(thing)[0].close()


def releaser_for(app: Celery, made: list[Any], **settings: Any) -> Releaser:
    store, defaults = delayed.store_for(app)
    # a store of the releaser's own, as beat gives it
    from celery_anarchon.backends import backend_from_settings
    from celery_anarchon.settings import Settings

    backend = backend_from_settings(Settings.from_app(app), instance="releaser-test")
    own = delayed.store_from_backend(backend)
    releaser = Releaser(
        app, own, replace(defaults, **settings), "releaser-test", namespace=backend.namespace
    )
    made.append(releaser)
    made.append(app)
    return releaser


def test_a_due_task_is_published_with_its_id_options_and_header_then_deleted(
    url: str, made: list[Any]
) -> None:
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    app = make_app(url, broker_url=BROKER)
    expires = datetime(2100, 1, 1, tzinfo=timezone.utc)
    task_id = delayed.park(
        app,
        "tests.by_name_only",
        (2, 3),
        {"z": 1},
        queue=queue,
        priority=3,
        expires=expires,
        headers={"mine": "yes"},
    )
    releaser = releaser_for(app, made)
    assert releaser.release_once() == 1
    assert delayed.count(app) == 0 and delayed.get(app, task_id) is None
    with Connection(BROKER) as conn:
        simple = conn.SimpleQueue(queue)
        message = simple.get(timeout=5)
        headers, body = dict(message.headers), message.decode()
        message.ack()
        simple.close()
    assert headers["id"] == task_id and headers["task"] == "tests.by_name_only"
    assert headers["anarchon_delayed"] == releaser.namespace
    assert headers["mine"] == "yes"
    assert datetime.fromisoformat(headers["expires"]) == expires
    assert body[0] == [2, 3] and body[1] == {"z": 1}
    assert releaser.counts.released == 1 and releaser.counts.lateness_ms[0] >= 0


def test_a_releaser_that_cannot_reach_its_broker_takes_nothing(url: str, made: list[Any]) -> None:
    """An outage is no task's fault, and one releaser's broken broker must
    not hold back what the others would send: it takes nothing."""
    app = make_app(url, broker_url="redis://127.0.0.1:1/0", broker_connection_timeout=0.5)
    task_id = delayed.park(app, "tests.add", (1, 1))
    before = delayed.get(app, task_id)
    releaser = releaser_for(app, made, retries=1)
    for _ in range(3):
        assert releaser.release_once() == 0
    got = delayed.get(app, task_id)
    assert got is not None and before is not None
    assert (got.state, got.due_ms, got.attempts, got.error) == (
        delayed.PENDING,
        before.due_ms,
        0,
        None,
    )
    assert releaser.counts.released == 0 and releaser.counts.failed == 0


def test_a_failing_publish_is_retried_with_backoff_then_marked_stuck(
    url: str, made: list[Any]
) -> None:
    """The broker takes the connection but each publish fails (a failure a
    healthy shared Redis cannot be made to show, so the publish is replaced
    by one that raises what kombu raises for a dropped connection)."""
    app = make_app(url, broker_url=BROKER)
    task_id = delayed.park(app, "tests.add", (1, 1))
    releaser = releaser_for(app, made, retries=2, stuck_retry_s=300.0)

    def failing_publish(item: Any, producer: Any) -> None:
        raise ConnectionResetError("connection reset by peer")

    releaser._writer._publish = failing_publish  # the batched path's publish
    releaser._publish = failing_publish  # type: ignore[method-assign]
    store = releaser.store
    for attempt in (1, 2, 3):
        assert store.reschedule(task_id, store.now_ms() - 1) or attempt == 1
        before = store.now_ms()
        assert releaser.release_once() == 1
        got = delayed.get(app, task_id)
        assert got is not None and got.state == delayed.PENDING  # never dropped
        assert got.attempts == attempt and got.error is not None
        assert "publish failed" in got.error
        expected = backoff_s(attempt, releaser.settings) * 1000
        assert expected - 50 <= got.due_ms - before <= expected + 2000
    assert got.error.startswith("stuck after 3 attempts")
    assert backoff_s(3, releaser.settings) == 300.0
    assert releaser.counts.released == 0 and releaser.counts.failed == 3


def test_a_task_that_cannot_be_decoded_fails_alone(url: str, made: list[Any]) -> None:
    """A pickled argument of a class the releasing process lacks: that task
    is refused and marked; the others of its batch are published."""
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    app = make_app(url, broker_url=BROKER, accept_content=["json", "pickle"])
    good = [delayed.park(app, "tests.by_name", (n, 0), queue=queue) for n in range(10)]
    store, _ = delayed.store_for(app)
    payload = encode_payload(
        task="tests.by_name",
        args=(1,),
        kwargs={},
        options={"queue": queue},
        serializer="json",
        key=None,
        parked_ms=store.now_ms(),
        due_ms=store.now_ms(),
    ).replace('"content_type":"application/json"', '"content_type":"application/x-nothing"')
    bad = store.new_id(None)
    store.park(
        [Parked(id=bad, key=None, task="tests.by_name", due_ms=store.now_ms(), payload=payload)]
    )
    good += [delayed.park(app, "tests.by_name", (n, 1), queue=queue) for n in range(10)]
    releaser = releaser_for(app, made)
    assert releaser.release_once() == 21
    assert len(read_queue(BROKER, queue, timeout=1)) == 20
    got = delayed.get(app, bad)
    assert got is not None and got.error is not None and got.error.startswith("refused")
    assert all(delayed.get(app, task_id) is None for task_id in good)


def test_expires_counts_from_the_release_also_after_a_reschedule(url: str, made: list[Any]) -> None:
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    app = make_app(url, broker_url=BROKER)
    task_id = delayed.park(app, "tests.by_name", (1,), countdown=3600, expires=60, queue=queue)
    assert delayed.reschedule(app, task_id, 0)  # due now
    releaser = releaser_for(app, made)
    assert releaser.release_once() == 1
    [headers] = read_queue(BROKER, queue, timeout=2)
    expires = datetime.fromisoformat(headers["expires"]).timestamp()
    assert 50 <= expires - time.time() <= 61


@pytest.mark.parametrize("name", ["postgresql", "mysql"])
def test_a_due_task_another_releaser_holds_does_not_make_a_busy_loop(
    name: str, made: list[Any], request: pytest.FixtureRequest
) -> None:
    """PostgreSQL, MySQL: a due row locked by another transaction (SKIP
    LOCKED passes it over) makes the releaser back off towards its poll."""
    require_service("redis")
    store_fixtures(request, name)
    import sqlalchemy as sa

    app = make_app(store_url(name, uuid.uuid4().hex[:6]), broker_url=BROKER)
    task_id = delayed.park(app, "tests.by_name", (1,))
    store, _ = delayed.store_for(app)
    table = f"{store.backend.prefix}delayed"  # type: ignore[attr-defined]
    url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sa.create_engine(url if name == "postgresql" else MYSQL_URL)
    releaser = releaser_for(app, made, poll_s=1.0)
    with engine.begin() as conn:
        conn.execute(sa.text(f"SELECT id FROM {table} WHERE id = :id FOR UPDATE"), {"id": task_id})
        started = time.process_time()
        releaser.start()
        time.sleep(3.0)
        cpu_s = time.process_time() - started
    engine.dispose()
    assert releaser._empty_rounds >= 5  # it kept finding the task due and locked
    assert cpu_s < 0.5, cpu_s  # a 10 ms busy loop for 3 s costs several times that
    deadline = time.time() + 5
    while releaser.counts.released == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert releaser.counts.released == 1  # released once the lock is gone


def test_arguments_the_signature_refuses_are_refused_at_park(url: str, made: list[Any]) -> None:
    app = make_app(url, broker_url=BROKER)
    made.append(app)
    with pytest.raises(TypeError, match="signature refuses"):
        delayed.park(app, "tests.add", (1, 2, 3))
    assert delayed.count(app) == 0


def test_a_message_celery_refuses_at_release_stays_parked_and_marked(
    url: str, made: list[Any]
) -> None:
    """Parked by name where the task is not registered (no check at park);
    the releasing process has it, and its signature refuses the call."""
    parking = make_app(url, broker_url=BROKER)
    made.append(parking)
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    task_id = delayed.park(parking, "tests.one_arg", (1, 2, 3), queue=queue)
    app = make_app(url, broker_url=BROKER)

    @app.task(name="tests.one_arg", shared=False)
    def one_arg(x: int) -> int:
        return x

    releaser = releaser_for(app, made)
    assert releaser.release_once() == 1
    got = delayed.get(app, task_id)
    assert got is not None and got.state == delayed.PENDING
    assert got.error is not None and got.error.startswith("refused")
    assert got.due_ms - releaser.store.now_ms() > 250_000  # the stuck retry, 300 s


def test_the_push_wakes_a_sleeping_releaser_long_before_its_poll(url: str, made: list[Any]) -> None:
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    app = make_app(url, broker_url=BROKER)
    releaser = releaser_for(app, made, poll_s=30.0)
    releaser.start()
    time.sleep(1.0)  # asleep on the push connection, up to 30 s
    due = time.time() + 0.5
    delayed.park(
        app, "tests.add", (1, 1), eta=datetime.fromtimestamp(due, timezone.utc), queue=queue
    )
    deadline = time.time() + 10
    while releaser.counts.released == 0 and time.time() < deadline:
        time.sleep(0.02)
    released_at = time.time()
    assert releaser.counts.released == 1
    assert due <= released_at < due + 1.5  # woken by the push, not the 30 s poll
    assert len(read_queue(BROKER, queue, timeout=1)) == 1


@pytest.mark.parametrize("name", ["mysql", "sqlite"])
def test_without_a_push_a_park_from_another_process_waits_at_most_the_poll(
    name: str, made: list[Any], request: pytest.FixtureRequest
) -> None:
    """MySQL and SQLite have no push: a task parked by another process, due
    at once, is released by the releaser's next look at the store, within
    ``anarchon_delayed_poll`` (1 s here)."""
    require_service("redis")
    store_fixtures(request, name)
    url = store_url(name, uuid.uuid4().hex[:6])
    queue = f"rel-{uuid.uuid4().hex[:8]}"
    app = make_app(url, broker_url=BROKER)
    delayed.count(app)  # the tables, before the releaser looks
    releaser = releaser_for(app, made, poll_s=1.0)
    releaser.start()
    time.sleep(1.5)  # asleep, nothing parked
    script = (
        "import sys, time; from celery import Celery; from celery_anarchon import delayed\n"
        f"app = Celery('other', broker={BROKER!r})\n"
        f"app.conf.anarchon_backend = {url!r}\n"
        f"delayed.park(app, 'tests.add', (1, 1), queue={queue!r})\n"
        "print(time.time())\n"
    )
    parked_at = float(
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    )
    deadline = time.time() + 10
    while releaser.counts.released == 0 and time.time() < deadline:
        time.sleep(0.02)
    released_at = time.time()
    assert releaser.counts.released == 1
    assert parked_at <= released_at < parked_at + 1.0 + 0.5  # the poll, and a round's slack
    assert len(read_queue(BROKER, queue, timeout=1)) == 1


def test_settings_are_checked(url: str) -> None:
    from celery_anarchon.exceptions import ConfigurationError

    for bad in (
        {"anarchon_delayed_lease": 0},
        {"anarchon_delayed_batch": 0},
        {"anarchon_delayed_release": "maybe"},
        {"anarchon_delayed_max_bytes": "big"},
    ):
        app = make_app(url, **bad)
        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            DelayedSettings.from_app(app)
