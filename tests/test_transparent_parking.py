"""Transparent parking (``ParkingTask`` and ``anarchon_park_countdown_over``):
what is parked and what is sent, on a real Redis store and broker, and real
``celery beat`` and ``celery worker`` processes running what was parked."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, group

from celery_anarchon import delayed
from celery_anarchon.delayed.parking import ParkingSettings, ParkingTask
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.settings import Settings

from .beats import BROKER, BeatCluster, read_queue
from .conftest import REDIS_URL, RUN_ID, require_service
from .parking_app import make_app


def store_url(tag: str) -> str:
    return f"{REDIS_URL}?prefix=anarchon-test:{RUN_ID}:{tag}:"


@pytest.fixture
def queue() -> str:
    return f"ptest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def app(queue: str, request: pytest.FixtureRequest) -> Iterator[Celery]:
    """An in-process app (no worker), parking countdowns over 60 s."""
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    made = make_app(BROKER, store_url(uuid.uuid4().hex[:6]), queue, anarchon_park_countdown_over=60)
    yield made
    store, _ = delayed.store_for(made)
    store.close()


def parked_options(app: Celery, task_id: str) -> dict[str, Any]:
    got = delayed.get(app, task_id)
    assert got is not None, f"{task_id} is not parked"
    options: dict[str, Any] = got.summary()["options"]
    return options


# -- the setting ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (600, 600.0), (0.5, 0.5), (0, 0.0), (timedelta(minutes=10), 600.0)],
)
def test_the_setting_takes_seconds_or_a_timedelta(value: Any, expected: float | None) -> None:
    app = Celery("s", set_as_current=False)
    app.conf.anarchon_park_countdown_over = value
    assert ParkingSettings.from_app(app).countdown_over_s == expected
    Settings.from_app(app)  # a known setting: not refused as a typo


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("600", "not text"),
        (-1, "must not be negative"),
        (True, "number of seconds"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ([600], "number of seconds"),
    ],
)
def test_bad_values_of_the_setting_are_refused(value: Any, message: str) -> None:
    app = Celery("s", set_as_current=False)
    app.conf.anarchon_park_countdown_over = value
    with pytest.raises(ConfigurationError, match="anarchon_park_countdown_over") as info:
        ParkingSettings.from_app(app)
    assert message in str(info.value)


def test_a_bad_setting_is_refused_at_the_first_call(queue: str) -> None:
    app = make_app(BROKER, None, queue, anarchon_park_countdown_over="1h")
    with pytest.raises(ConfigurationError, match="anarchon_park_countdown_over"):
        app.tasks["ptest.add"].apply_async((1, 2), countdown=5)
    assert read_queue(BROKER, queue, timeout=0.3) == []  # nothing sent either


def test_task_cls_in_its_string_form_makes_every_task_a_parking_task(app: Celery) -> None:
    assert isinstance(app.tasks["ptest.add"], ParkingTask)


# -- what is parked, what is sent ------------------------------------------------


def test_a_short_countdown_and_delay_go_straight_to_the_broker(app: Celery, queue: str) -> None:
    add = app.tasks["ptest.add"]
    short = add.apply_async((1, 2), countdown=30)
    at_threshold = add.apply_async((1, 2), countdown=60)
    now = add.delay(1, 2)
    sent = read_queue(BROKER, queue, timeout=0.5)
    assert sorted(h["id"] for h in sent) == sorted([short.id, at_threshold.id, now.id])
    etas = {h["id"]: h["eta"] for h in sent}
    assert etas[short.id] is not None and etas[now.id] is None
    assert delayed.count(app) == 0


def test_a_long_countdown_is_parked_under_the_callers_task_id(app: Celery, queue: str) -> None:
    add = app.tasks["ptest.add"]
    task_id = str(uuid.uuid4())
    before_ms = int(time.time() * 1000)
    result = add.apply_async((2, 3), countdown=3600, task_id=task_id, priority=3)
    assert result.id == task_id and isinstance(result, type(add.AsyncResult(task_id)))
    got = delayed.get(app, task_id)
    assert got is not None and got.state == delayed.PENDING and got.task == "ptest.add"
    assert before_ms + 3_600_000 <= got.due_ms <= int(time.time() * 1000) + 3_600_000
    summary = got.summary()
    assert (summary["args"], summary["kwargs"]) == ([2, 3], {})
    assert summary["options"]["priority"] == 3
    generated = add.apply_async((1, 1), countdown=7200)  # no task_id: one is made
    assert delayed.get(app, generated.id) is not None
    assert read_queue(BROKER, queue, timeout=0.5) == []  # in the store, not in the broker
    assert delayed.count(app) == 2


def test_a_task_id_still_parked_is_refused_not_dropped(app: Celery) -> None:
    """Celery would send both calls; one id holds one parked task, so the
    second call raises, naming the id, and the first stays as it was."""
    add = app.tasks["ptest.add"]
    task_id = str(uuid.uuid4())
    add.apply_async((1, 2), countdown=3600, task_id=task_id)
    with pytest.raises(ValueError, match=f"task id {task_id} is parked already"):
        add.apply_async((5, 6), countdown=7200, task_id=task_id)
    got = delayed.get(app, task_id)
    assert got is not None and got.summary()["args"] == [1, 2]


def test_an_eta_further_than_the_threshold_is_parked_at_that_instant(
    app: Celery, queue: str
) -> None:
    add = app.tasks["ptest.add"]
    eta = datetime.now(timezone.utc) + timedelta(hours=2)
    aware = add.apply_async((1, 2), eta=eta)
    naive = add.apply_async((1, 2), eta=eta.replace(tzinfo=None))  # read as UTC, as Celery does
    soon = add.apply_async((1, 2), eta=datetime.now(timezone.utc) + timedelta(seconds=20))
    for result in (aware, naive):
        got = delayed.get(app, result.id)
        assert got is not None and abs(got.due_ms - int(eta.timestamp() * 1000)) <= 1
    assert [h["id"] for h in read_queue(BROKER, queue, timeout=0.5)] == [soon.id]


def test_expires_in_seconds_counts_from_the_call_as_celery_counts_it(app: Celery) -> None:
    result = app.tasks["ptest.add"].apply_async((1, 2), countdown=3600, expires=600)
    expires = datetime.fromisoformat(parked_options(app, result.id)["expires"])
    expected = datetime.now(timezone.utc) + timedelta(seconds=600)
    assert abs((expires - expected).total_seconds()) < 5


def test_signatures_chains_and_links_are_parked_with_what_they_carry(app: Celery) -> None:
    add = app.tasks["ptest.add"]
    link = app.tasks["ptest.record_result"].s("/tmp/unused")
    from_signature = add.s(2).set(queue="billing").apply_async((3,), countdown=3600, link=link)
    options = parked_options(app, from_signature.id)
    assert options["queue"] == "billing"
    assert [s["task"] for s in options["link"]] == ["ptest.record_result"]
    steps = chain(add.s(1, 2), add.s(10)).apply_async(countdown=3600)
    first = delayed.pending(app, limit=10)
    chained = [t for t in first if t.id != from_signature.id]
    assert len(chained) == 1 and chained[0].id != steps.id  # the chain's first task
    assert [s["task"] for s in chained[0].summary()["options"]["chain"]] == ["ptest.add"]
    grouped = group(add.s(1, 1), add.s(2, 2)).apply_async(countdown=3600)
    members = [parked_options(app, r.id) for r in grouped.results]
    assert [(m["group_id"], m["group_index"]) for m in members] == [
        (grouped.id, 0),
        (grouped.id, 1),
    ]


def test_options_a_parked_task_cannot_keep_are_refused_with_the_fix(
    app: Celery, queue: str
) -> None:
    add = app.tasks["ptest.add"]
    for options in ({"mandatory": True}, {"declare": []}, {"stamped_headers": ["x"], "x": 1}):
        with pytest.raises(TypeError) as info:
            add.apply_async((1, 2), countdown=3600, **options)
        message = str(info.value)
        assert "anarchon_park_countdown_over" in message and "anarchon_park=False" in message
        assert next(iter(options)) in message
    assert delayed.count(app) == 0
    # The fix named: Celery's own countdown for that one call.
    sent = add.apply_async((1, 2), countdown=3600, mandatory=True, anarchon_park=False)
    assert [h["id"] for h in read_queue(BROKER, queue, timeout=0.5)] == [sent.id]
    assert delayed.count(app) == 0


def test_bad_arguments_are_refused_as_apply_async_refuses_them(app: Celery) -> None:
    with pytest.raises(TypeError, match="signature refuses"):
        app.tasks["ptest.add"].apply_async((1, 2, 3), countdown=3600)
    assert delayed.count(app) == 0


def test_a_retry_waits_while_its_attempt_is_in_flight_then_parks(app: Celery) -> None:
    """A released attempt that retries at once can find itself still in
    flight (its releaser deletes it after the publish): the retry waits for
    the delete, then parks, instead of writing nothing."""
    add = app.tasks["ptest.add"]
    task_id = delayed.park(app, add, (1, 2))  # due now
    store, _ = delayed.store_for(app)
    [taken] = store.take_due(10, 30_000, "test-releaser")
    results: list[Any] = []
    retry = threading.Thread(
        target=lambda: results.append(
            add.apply_async((1, 2), countdown=3600, task_id=task_id, retries=1)
        )
    )
    retry.start()
    time.sleep(0.5)
    assert retry.is_alive()  # waiting for the release to finish
    assert store.finish([taken]) == [True]
    retry.join(10)
    assert [r.id for r in results] == [task_id]
    assert parked_options(app, task_id)["retries"] == 1


def test_a_retry_replaces_a_given_back_copy_of_its_own_attempt(app: Celery) -> None:
    add = app.tasks["ptest.add"]
    task_id = str(uuid.uuid4())
    delayed.park(app, add, (1, 2), countdown=3600, task_id=task_id)  # attempt 0, pending
    add.apply_async((1, 2), countdown=3600, task_id=task_id, retries=1)
    assert parked_options(app, task_id)["retries"] == 1
    other = str(uuid.uuid4())
    delayed.park(app, add, (1, 2), countdown=3600, task_id=other, retries=5)
    with pytest.raises(RuntimeError, match="pending as attempt 5"):
        add.apply_async((1, 2), countdown=3600, task_id=other, retries=1)
    assert parked_options(app, other)["retries"] == 5


def test_task_always_eager_runs_eagerly_as_celery_does(queue: str) -> None:
    app = make_app(BROKER, None, queue, anarchon_park_countdown_over=60, task_always_eager=True)
    result = app.tasks["ptest.add"].apply_async((2, 5), countdown=3600)
    assert result.get() == 7  # ran here, with no store configured at all


def test_without_the_setting_a_long_countdown_is_sent(queue: str) -> None:
    require_service("redis")
    app = make_app(BROKER, None, queue)
    result = app.tasks["ptest.add"].apply_async((1, 2), countdown=3600)
    assert [h["id"] for h in read_queue(BROKER, queue, timeout=0.5)] == [result.id]


# -- real beat and worker ------------------------------------------------------


def lines(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line]


def wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return bool(check())


def test_parked_calls_and_a_parked_retry_run_once_through_a_real_beat_and_worker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Parking over 1 s: a countdown, an eta, a chain and a link are parked,
    released by a real beat, run once by a real worker, and their results
    read back; a retry over the threshold is parked by the worker, released,
    and runs once; a second delivery of that retry is discarded."""
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    url = store_url(uuid.uuid4().hex[:6])
    conf = {"anarchon_park_countdown_over": 1}
    cluster = BeatCluster(url, tmp_path, conf=conf, app="tests.parking_app")
    app = make_app(BROKER, url, cluster.queue, **conf)
    out, linked = tmp_path / "stamps.txt", tmp_path / "linked.txt"
    try:
        cluster.start(1)
        cluster.start_worker()
        assert cluster.wait_ticking(timeout=60), cluster.logs()
        add, stamp = app.tasks["ptest.add"], app.tasks["ptest.stamp"]
        by_countdown = add.apply_async((2, 3), countdown=3)
        by_eta = stamp.apply_async(
            (str(out), "eta"), eta=datetime.now(timezone.utc) + timedelta(seconds=3)
        )
        chained = chain(add.s(1, 2), add.s(10)).apply_async(countdown=3)
        with_link = add.apply_async(
            (4, 4), countdown=3, link=app.tasks["ptest.record_result"].s(str(linked))
        )
        retried = app.tasks["ptest.retry_later"].apply_async((str(out), 3))
        assert delayed.get(app, by_countdown.id) is not None
        assert delayed.get(app, by_eta.id) is not None

        assert by_countdown.get(timeout=60) == 5
        assert by_eta.get(timeout=60) == "eta"
        assert chained.get(timeout=60) == 13
        assert with_link.get(timeout=60) == 8
        assert retried.get(timeout=60) == "done after 1 retry"
        assert wait_for(lambda: lines(linked) == [["linked", "8"]], 20), cluster.logs()

        # A second delivery of the released retry (what a take-over would
        # publish): the same id, the same retries count, the headers.
        [parking] = [row[5] for row in lines(out) if row[0] == "attempt-1"]
        assert parking != "-"
        app.send_task(
            "ptest.retry_later",
            (str(out), 3),
            task_id=retried.id,
            retries=1,
            headers={"anarchon_delayed": "test", "anarchon_parking": parking},
        )
        worker_log = tmp_path / "worker-1.log"
        assert wait_for(
            lambda: "discarded a second delivery of released task" in worker_log.read_text(), 20
        ), cluster.logs()
        time.sleep(1)
        assert delayed.count(app) == 0
        # The id of a task that ran, parked again: a new parking, so it runs
        # again, as Celery runs a reused id.
        again = stamp.apply_async((str(out), "reused"), countdown=2, task_id=by_eta.id)
        assert again.id == by_eta.id
        assert wait_for(lambda: any(row[0] == "reused" for row in lines(out)), 30), cluster.logs()
    finally:
        cluster.stop_workers()
        cluster.stop()
    stamps = {(tag, task_id): (retries, how) for tag, task_id, retries, how, *_ in lines(out)}
    # eta once; attempt 0 and the retry once each; the reused id once
    assert len(lines(out)) == 4, lines(out)
    assert stamps[("reused", by_eta.id)] == ("0", "released")
    assert stamps[("eta", by_eta.id)] == ("0", "released")
    assert stamps[("attempt-0", retried.id)] == ("0", "sent")  # no countdown: sent
    assert stamps[("attempt-1", retried.id)] == ("1", "released")  # parked, then released
    assert read_queue(BROKER, cluster.queue, timeout=0.5) == []
