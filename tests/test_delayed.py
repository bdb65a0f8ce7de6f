"""Delayed tasks end to end: the API's answers and refusals, and real
``celery beat`` processes releasing parked tasks once, to a real worker."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu.exceptions import EncodeError

from celery_anarchon import delayed
from celery_anarchon.exceptions import BackendUnavailable, ConfigurationError

from .beats import BeatCluster, read_queue
from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, RUN_ID, require_service

STORES = ["redis", "postgresql", "mysql", "sqlite"]

#: The folder of the SQLite stores' files (one per tag).
SQLITE_DIR = Path(tempfile.gettempdir()) / f"anarchon-test-{RUN_ID}"


def store_url(name: str, tag: str) -> str:
    """A backend URL of kind ``name`` with a prefix of ``tag``'s own (for
    SQLite, a file of its own too)."""
    if name == "redis":
        return f"{REDIS_URL}?prefix=anarchon-test:{RUN_ID}:{tag}:"
    if name == "sqlite":
        SQLITE_DIR.mkdir(exist_ok=True)
        return f"sqlite:///{SQLITE_DIR / tag}.db?prefix=t{RUN_ID}_{tag}_"
    url = {"postgresql": POSTGRES_URL, "mysql": MYSQL_URL}[name]
    return f"{url}?prefix=t{RUN_ID}_{tag}_"


def store_fixtures(request: pytest.FixtureRequest, name: str) -> None:
    """Require the store ``name``'s service and its clean-up (SQLite: the
    files of :data:`SQLITE_DIR`, after the test)."""
    require_service(name)
    if name == "redis":
        request.getfixturevalue("_redis_cleanup")
    elif name == "sqlite":
        request.addfinalizer(lambda: shutil.rmtree(SQLITE_DIR, ignore_errors=True))
    else:
        request.getfixturevalue("_sql_cleanup")


def make_app(url: str, **conf: Any) -> Celery:
    app = Celery(f"delayed-{uuid.uuid4().hex[:6]}", broker="redis://127.0.0.1:6379/1")
    app.conf.update({"anarchon_backend": url, "task_default_queue": "delayed-unused", **conf})

    @app.task(name="tests.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


@pytest.fixture(params=STORES)
def app(request: pytest.FixtureRequest) -> Iterator[Celery]:
    name: str = request.param
    store_fixtures(request, name)
    made = make_app(store_url(name, uuid.uuid4().hex[:6]))
    yield made
    store, _ = delayed.store_for(made)
    store.close()


def test_park_get_count_and_cancel(app: Celery) -> None:
    task_id = delayed.park(app, app.tasks["tests.add"], (2, 3), countdown=60, queue="q1")
    found = delayed.get(app, task_id)
    assert found is not None and found.state == delayed.PENDING and found.task == "tests.add"
    summary = found.summary()
    assert (summary["args"], summary["kwargs"], summary["options"]) == ([2, 3], {}, {"queue": "q1"})
    assert delayed.count(app) == 1
    assert [t.id for t in delayed.pending(app)] == [task_id]
    assert delayed.cancel(app, task_id) is True
    assert delayed.cancel(app, task_id) is False  # gone: answered definitely
    assert delayed.get(app, task_id) is None and delayed.count(app) == 0


def test_a_key_makes_parking_idempotent_while_pending(app: Celery) -> None:
    first = delayed.park(app, "tests.add", (1, 1), countdown=60, key="invoice-42")
    again = delayed.park(app, "tests.add", (9, 9), countdown=5, key="invoice-42")
    assert again == first
    got = delayed.get(app, "invoice-42")
    assert got is not None and got.id == first and got.summary()["args"] == [1, 1]
    assert delayed.cancel(app, "invoice-42") is True
    third = delayed.park(app, "tests.add", (2, 2), countdown=60, key="invoice-42")
    assert third != first  # the first is gone: a new task, a new id


def test_reschedule_moves_a_pending_task(app: Celery) -> None:
    task_id = delayed.park(app, "tests.add", (1, 2), countdown=600)
    eta = datetime.now(timezone.utc) + timedelta(hours=2)
    assert delayed.reschedule(app, task_id, eta) is True
    got = delayed.get(app, task_id)
    assert got is not None and abs(got.due_ms - int(eta.timestamp() * 1000)) <= 1
    assert delayed.reschedule(app, "no-such-task", 10) is False


def test_park_many_parks_in_order(app: Celery) -> None:
    ids = delayed.park_many(
        app, [{"task": "tests.add", "args": (n, n), "countdown": 100 + n} for n in range(50)]
    )
    assert len(set(ids)) == 50 and delayed.count(app) == 50
    assert [t.id for t in delayed.pending(app, limit=50)] == ids


def test_a_signature_parks_its_args_and_options(app: Celery) -> None:
    """Merged as Signature.apply_async merges (the call's args first; an
    immutable signature keeps its own), checked against Celery's merge."""
    partial = app.tasks["tests.add"].s(2).set(queue="q9")
    task_id = delayed.park(app, partial, (3,), countdown=60)
    got = delayed.get(app, task_id)
    assert got is not None
    summary = got.summary()
    assert (summary["task"], summary["args"], summary["options"]) == (
        "tests.add",
        [3, 2],
        {"queue": "q9"},
    )
    assert list(partial._merge((3,), {}, {})[0]) == summary["args"]
    immutable = app.tasks["tests.add"].si(5, 6)
    kept = delayed.get(app, delayed.park(app, immutable, (7,), countdown=60))
    assert kept is not None and kept.summary()["args"] == [5, 6]
    with pytest.raises(TypeError, match="signature refuses"):
        delayed.park(app, app.tasks["tests.add"].s(1, 2), (3,))


def test_park_many_refuses_a_key_it_does_not_know(app: Celery) -> None:
    for call in (
        {"task": "tests.add", "args": (1, 2), "countdwn": 900},
        {"task": "tests.add", "args": (1, 2), "queue": "billing"},
    ):
        with pytest.raises(TypeError, match="unknown key"):
            delayed.park_many(app, [call])
    assert delayed.count(app) == 0


def test_bad_input_is_refused_at_park(app: Celery) -> None:
    with pytest.raises(ValueError, match="naive"):
        delayed.park(app, "tests.add", (1, 2), eta=datetime.now() + timedelta(hours=1))
    with pytest.raises(ValueError, match="not both"):
        delayed.park(app, "tests.add", eta=datetime.now(timezone.utc), countdown=5)
    with pytest.raises(EncodeError):  # json refuses the object: at park, not at release
        delayed.park(app, "tests.add", (object(), 1), countdown=5)
    with pytest.raises(ValueError, match="anarchon_delayed_max_bytes"):
        delayed.park(app, "tests.add", ("x" * 300_000, 1), countdown=5)
    with pytest.raises(TypeError, match="mandatory"):
        delayed.park(app, "tests.add", (1, 2), countdown=5, mandatory=True)
    with pytest.raises(TypeError, match="countdown"):
        delayed.park(app, "tests.add", (1, 2), options_countdown=5)
    with pytest.raises(ValueError, match="task_id"):
        delayed.park(app, "tests.add", (1, 2), key="k", task_id="abc")
    assert delayed.count(app) == 0  # nothing parked by a refused call


def test_an_eta_in_the_past_is_due_at_once_and_an_unknown_task_is_parked_by_name(
    app: Celery,
) -> None:
    past = datetime.now(timezone.utc) - timedelta(days=1)
    task_id = delayed.park(app, "nobody.defines.this", (1,), eta=past)
    got = delayed.get(app, task_id)
    assert got is not None and got.task == "nobody.defines.this"
    store, _ = delayed.store_for(app)
    [taken] = store.take_due(10, 5_000, "test")
    assert taken.task.id == task_id  # due at once


def test_a_store_that_is_down_raises_backend_unavailable() -> None:
    app = make_app("redis://127.0.0.1:1/0?socket_timeout=0.5")
    with pytest.raises(BackendUnavailable):
        delayed.park(app, "tests.add", (1, 2), countdown=5)


def test_a_backend_without_a_delayed_store_is_refused_clearly() -> None:
    from celery_anarchon.backends import backend_from_url

    rabbit = backend_from_url("amqp://guest:guest@127.0.0.1:5672//", instance="delayed-test")
    with pytest.raises(ConfigurationError, match="Redis, PostgreSQL, MySQL/MariaDB or SQLite"):
        delayed.store_from_backend(rabbit)


def test_a_sqlite_store_parks_and_warns_that_it_serves_one_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}")
    with caplog.at_level("WARNING", logger="celery_anarchon.delayed.sql"):
        task_id = delayed.park(app, "tests.add", (1, 2), countdown=5)
    assert delayed.get(app, task_id) is not None
    [warning] = [r.getMessage() for r in caplog.records if "local SQLite file" in r.getMessage()]
    assert "other hosts do not see them" in warning and str(tmp_path) in warning
    delayed.store_for(app)[0].close()


def test_cancel_against_a_concurrent_release_answers_definitely(app: Celery) -> None:
    """Each task is either cancelled (True) or taken by the releaser, never
    both and never neither."""
    ids = delayed.park_many(app, [{"task": "tests.add", "args": (n, 0)} for n in range(300)])
    store, _ = delayed.store_for(app)
    taken: list[str] = []

    def release() -> None:
        while len(taken) < 300:
            batch = store.take_due(25, 30_000, "racer")
            if not batch and delayed.count(app) == len(taken):
                return
            taken.extend(t.task.id for t in batch)

    racer = threading.Thread(target=release)
    racer.start()
    cancelled = [task_id for task_id in ids if delayed.cancel(app, task_id)]
    racer.join(30)
    assert not set(cancelled) & set(taken)
    assert sorted(cancelled + taken) == sorted(ids)


# -- real beats ------------------------------------------------------------------


def stamped(path: Path) -> list[tuple[str, str, int]]:
    """The ``itest.stamp`` lines: (tag, task id, epoch ms)."""
    if not path.exists():
        return []
    return [
        (t, i, int(ms))
        for t, i, ms in (line.split() for line in path.read_text().split("\n") if line)
    ]


@pytest.mark.parametrize("name", STORES)
def test_three_beats_release_every_parked_task_once_and_never_early(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    require_service("redis")  # the broker
    store_fixtures(request, name)
    url = store_url(name, uuid.uuid4().hex[:6])
    cluster = BeatCluster(url, tmp_path, conf={"beat_schedule": {}})
    out = tmp_path / "stamps.txt"
    app = make_app(url, task_default_queue=cluster.queue)
    try:
        cluster.start(3)
        cluster.start_worker()
        assert cluster.wait_ticking(timeout=60), cluster.logs()
        start = time.time() + 2
        dues = [start + n * 0.01 for n in range(400)]
        ids = delayed.park_many(
            app,
            [
                {
                    "task": "itest.stamp",
                    "args": (str(out), str(int(due * 1000))),
                    "eta": datetime.fromtimestamp(due, timezone.utc),
                }
                for due in dues
            ],
        )
        deadline = time.time() + 60
        while len(stamped(out)) < len(ids) and time.time() < deadline:
            time.sleep(0.5)
        time.sleep(1)  # a duplicate would arrive by now
        runs = stamped(out)
        assert delayed.count(app) == 0
    finally:
        cluster.stop_workers()
        cluster.stop()
    executed = Counter(task_id for _, task_id, _ in runs)
    assert set(executed) == set(ids), cluster.logs()
    assert max(executed.values()) == 1, cluster.logs()
    early = [(tag, ms) for tag, _, ms in runs if ms < int(tag)]
    assert early == []
    assert read_queue(cluster.broker, cluster.queue, timeout=0.5) == []
    assert "database is locked" not in cluster.logs(tail=10**7)  # SQLite: one file, 3 beats


def test_a_second_delivery_of_a_released_task_is_discarded_by_the_worker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A duplicate publish (what a take-over after a releaser died between
    publish and delete does: the same headers) runs once; the same task id
    parked again (another parking id) runs again, as Celery runs a reused
    id."""
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    url = store_url("redis", uuid.uuid4().hex[:6])
    cluster = BeatCluster(url, tmp_path, conf={"beat_schedule": {}})
    out = tmp_path / "stamps.txt"
    app = make_app(url, task_default_queue=cluster.queue)
    try:
        cluster.start_worker()
        task_id = str(uuid.uuid4())
        for parking in ("first", "first", "first", "second"):
            app.send_task(
                "itest.stamp",
                (str(out), "0"),
                task_id=task_id,
                headers={"anarchon_delayed": "test", "anarchon_parking": parking},
            )
        deadline = time.time() + 30
        while len(stamped(out)) < 2 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        logs = (tmp_path / "worker-1.log").read_text()
    finally:
        cluster.stop_workers()
    assert [i for _, i, _ in stamped(out)] == [task_id, task_id]
    assert logs.count("discarded a second delivery of released task") == 2
