"""``celery anarchon delayed list|show|cancel|reschedule|count`` against real
Redis and PostgreSQL stores; the refusal of a backend that keeps no delayed
tasks; the arguments' parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_anarchon import delayed
from celery_anarchon.cli import EXIT_CONFIG, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE
from celery_anarchon.cli_common import Fail
from celery_anarchon.cli_delayed import parse_before, parse_when

from .beats import REPO
from .conftest import REDIS_URL, require_service
from .test_cli import invoke, invoke_json, make_app
from .test_cli_schedules import fails
from .test_delayed import STORES, store_fixtures
from .test_delayed import store_url as delayed_store_url


def store_url(name: str) -> str:
    """A backend URL of kind ``name`` with a prefix of its own, under the
    run's prefix (conftest's clean-up fixtures drop it)."""
    return delayed_store_url(name, f"cli{uuid.uuid4().hex[:6]}")


def delayed_app(url: str, **conf: Any) -> Celery:
    """``tests.test_cli.make_app`` on ``url``, with the task ``itest.add``."""
    app = make_app(anarchon_backend=url, **conf)

    @app.task(name="itest.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    return app


@pytest.fixture(params=STORES)
def app(request: pytest.FixtureRequest) -> Iterator[Celery]:
    """An app whose backend is a store of the parametrised kind, in a
    namespace of the test's own."""
    name: str = request.param
    store_fixtures(request, name)
    made = delayed_app(store_url(name))
    if name == "sqlite":  # the file beat would have made
        delayed.store_for(made)[0].backend.open()  # type: ignore[attr-defined]
    yield made
    delayed.store_for(made)[0].close()


def ms_of(at: datetime) -> int:
    return int(at.timestamp() * 1000)


# -- list, show, count ---------------------------------------------------------------


@pytest.mark.services
def test_list_show_and_count_what_was_parked(app: Celery) -> None:
    now = datetime.now(timezone.utc)
    first = delayed.park(app, "itest.add", (2, 3), eta=now + timedelta(minutes=5), key="invoice-42")
    second = delayed.park(
        app,
        "proj.not_registered",
        kwargs={"to": "ops"},
        eta=now + timedelta(hours=2),
        queue="billing",
        priority=3,
        expires=60,
    )
    third = delayed.park(app, "itest.add", (1, 1), eta=now + timedelta(days=1))

    listed = invoke_json(app, "delayed", "list")
    assert listed["count"] == 3 and listed["limit"] == 50 and listed["before_ms"] is None
    assert [t["id"] for t in listed["tasks"]] == [first, second, third]
    head = listed["tasks"][0]
    assert head["key"] == "invoice-42" and head["task"] == "itest.add"
    assert head["state"] == "pending" and head["attempts"] == 0 and head["error"] is None
    assert head["due_ms"] == ms_of(now + timedelta(minutes=5))
    assert head["due"].endswith("Z") and head["lease_until_ms"] is None
    assert head["args"] == [2, 3] and head["kwargs"] == {}
    assert listed["tasks"][1]["options"]["queue"] == "billing"
    # ``expires`` in seconds is kept as seconds: Celery counts them from the
    # send, which is the release.
    assert listed["tasks"][1]["options"]["expires"] == 60.0

    text = invoke(app, "delayed", "list")
    assert text.exit_code == EXIT_OK, text.output
    lines = text.stdout.splitlines()
    assert lines[0].startswith("store: delayed store in ")
    assert lines[1] == "3 parked task(s); the 3 earliest:"
    assert lines[2].split() == ["ID", "KEY", "TASK", "DUE", "(UTC)", "STATE", "ATTEMPTS", "ERROR"]
    assert lines[3].split()[:3] == [first, "invoice-42", "itest.add"]
    assert lines[4].split()[:3] == [second, "-", "proj.not_registered"]

    limited = invoke_json(app, "delayed", "list", "--limit", "2")
    assert [t["id"] for t in limited["tasks"]] == [first, second] and limited["count"] == 3

    # --before: aware, or without a zone read as UTC; a task due exactly
    # then is not before it.
    cut = now + timedelta(hours=1)
    for text_at in (cut.isoformat(), cut.astimezone(timezone(timedelta(hours=5))).isoformat()):
        before = invoke_json(app, "delayed", "list", "--before", text_at)
        assert [t["id"] for t in before["tasks"]] == [first], text_at
        assert before["before_ms"] == ms_of(cut)
    naive = cut.replace(tzinfo=None).isoformat()
    assert [t["id"] for t in invoke_json(app, "delayed", "list", "--before", naive)["tasks"]] == [
        first
    ]
    exact = (now + timedelta(minutes=5)).isoformat()
    assert invoke_json(app, "delayed", "list", "--before", exact)["tasks"] == []
    empty = invoke(app, "delayed", "list", "--before", "2000-01-01T00:00Z")
    assert empty.exit_code == EXIT_OK
    assert "3 parked task(s); none due before 2000-01-01T00:00:00Z to show" in empty.stdout

    assert invoke_json(app, "delayed", "count")["count"] == 3
    counted = invoke(app, "delayed", "count")
    assert counted.exit_code == EXIT_OK and counted.stdout.startswith("3 parked task(s)")

    by_key = invoke_json(app, "delayed", "show", "invoice-42")
    assert by_key == head
    by_id = invoke_json(app, "delayed", "show", second)
    assert by_id["kwargs"] == {"to": "ops"} and by_id["options"]["priority"] == 3
    shown = invoke(app, "delayed", "show", "invoice-42")
    assert shown.exit_code == EXIT_OK, shown.output
    fields = {line.split()[0]: line.split(None, 1)[1] for line in shown.stdout.splitlines()[1:]}
    assert shown.stdout.splitlines()[0] == "invoice-42"
    assert fields["id"] == first and fields["state"] == "pending"
    assert fields["args"] == "[2, 3]" and fields["kwargs"] == "{}" and fields["options"] == "{}"


@pytest.mark.services
def test_show_of_a_task_not_parked_is_a_usage_error(app: Celery) -> None:
    message = fails(app, "delayed", "show", "no-such-key", code=EXIT_USAGE)
    assert "no parked task has the key or id 'no-such-key'" in message


@pytest.mark.services
def test_a_key_with_a_newline_stays_one_cell(app: Celery) -> None:
    delayed.park(app, "itest.add", (1, 2), countdown=60, key="two\nlines")
    text = invoke(app, "delayed", "list")
    assert text.exit_code == EXIT_OK
    assert len(text.stdout.splitlines()) == 4 and "two\\nlines" in text.stdout
    assert invoke_json(app, "delayed", "show", "two\nlines")["key"] == "two\nlines"


# -- cancel ------------------------------------------------------------------------


@pytest.mark.services
def test_cancel_deletes_a_pending_task_once(app: Celery) -> None:
    task_id = delayed.park(app, "itest.add", (2, 3), countdown=600, key="invoice-42")
    other = delayed.park(app, "itest.add", (4, 5), countdown=600)

    done = invoke(app, "delayed", "cancel", "invoice-42")
    assert done.exit_code == EXIT_OK, done.output
    assert done.stdout == (
        f"invoice-42: cancelled (task itest.add, id {task_id}); it will not be sent\n"
    )
    assert delayed.get(app, task_id) is None and delayed.count(app) == 1

    again = invoke(app, "delayed", "cancel", "invoice-42")
    assert again.exit_code == EXIT_PROBLEM
    assert "not cancelled: no task is pending under that key or id" in again.stdout
    report = invoke_json(app, "delayed", "cancel", task_id, code=EXIT_PROBLEM)
    assert report == {"key_or_id": task_id, "action": "cancel", "was_pending": False, "task": None}

    by_id = invoke_json(app, "delayed", "cancel", other)
    assert by_id["was_pending"] is True and by_id["task"]["id"] == other
    assert invoke_json(app, "delayed", "count")["count"] == 0


# -- reschedule ----------------------------------------------------------------------


@pytest.mark.services
def test_reschedule_moves_a_pending_task(app: Celery) -> None:
    task_id = delayed.park(app, "itest.add", (2, 3), countdown=600, key="invoice-42")

    at = "2030-01-01T09:00:00+01:00"
    moved = invoke_json(app, "delayed", "reschedule", "invoice-42", at)
    assert moved["was_pending"] is True and moved["due"] == "2030-01-01T08:00:00Z"
    assert moved["task"]["id"] == task_id and moved["task"]["due_ms"] == moved["due_ms"]
    assert delayed.get(app, task_id).due_ms == moved["due_ms"]  # type: ignore[union-attr]

    for when, seconds in (("+90", 90.0), ("30", 30.0), ("+0.5", 0.5)):
        before = time.time()
        result = invoke_json(app, "delayed", "reschedule", task_id, when)
        after = time.time()
        assert result["was_pending"] is True
        assert (before + seconds) * 1000 - 1 <= result["due_ms"] <= (after + seconds) * 1000 + 1
        stored = delayed.get(app, task_id)
        assert stored is not None and stored.due_ms == result["due_ms"]

    text = invoke(app, "delayed", "reschedule", "invoice-42", "2031-06-01T00:00Z")
    assert text.exit_code == EXIT_OK, text.output
    assert text.stdout == (
        f"invoice-42: rescheduled to 2031-06-01T00:00:00Z (task itest.add, id {task_id})\n"
    )

    naive = fails(app, "delayed", "reschedule", "invoice-42", "2031-06-01T00:00")
    assert "WHEN '2031-06-01T00:00' has no time zone" in naive
    assert "e.g. 2031-06-01T00:00Z (UTC) or 2031-06-01T00:00+01:00" in naive  # the time given
    garbage = fails(app, "delayed", "reschedule", "invoice-42", "tomorrow")
    assert "WHEN 'tomorrow' is not ISO 8601" in garbage
    assert delayed.get(app, task_id).due_ms == ms_of(  # type: ignore[union-attr]
        datetime(2031, 6, 1, tzinfo=timezone.utc)
    )

    missing = invoke(app, "delayed", "reschedule", "no-such-key", "+60")
    assert missing.exit_code == EXIT_PROBLEM
    assert "no-such-key: not rescheduled: no task is pending" in missing.stdout
    report = invoke_json(app, "delayed", "reschedule", "no-such-key", "+60", code=EXIT_PROBLEM)
    assert report["was_pending"] is False and report["task"] is None


# -- in flight and failed publishes --------------------------------------------------


@pytest.mark.services
def test_a_task_in_flight_is_listed_and_neither_cancelled_nor_rescheduled(app: Celery) -> None:
    task_id = delayed.park(app, "itest.add", (2, 3), key="invoice-42")  # due now
    store, _ = delayed.store_for(app)
    [taken] = store.take_due(10, 60_000, "test-releaser")
    assert taken.task.id == task_id

    listed = invoke_json(app, "delayed", "list")
    [item] = listed["tasks"]
    assert item["state"] == "in flight" and item["id"] == task_id
    assert item["lease_until_ms"] == taken.now_ms + 60_000
    assert item["due_ms"] == taken.task.due_ms  # when it was due, not the lease
    shown = invoke(app, "delayed", "show", "invoice-42")
    assert "  state     in flight\n" in shown.stdout and "  lease     until " in shown.stdout

    for args in (["cancel", "invoice-42"], ["reschedule", task_id, "+60"]):
        result = invoke(app, "delayed", *args)
        assert result.exit_code == EXIT_PROBLEM, result.output
        assert "it is in flight (being released now), so it will be sent" in result.stdout
        report = invoke_json(app, "delayed", *args, code=EXIT_PROBLEM)
        assert report["was_pending"] is False and report["task"]["state"] == "in flight"
    assert delayed.count(app) == 1


@pytest.mark.services
def test_a_failed_publish_shows_its_attempts_and_masked_error(app: Celery) -> None:
    delayed.park(app, "itest.add", (2, 3), key="invoice-42")
    store, _ = delayed.store_for(app)
    taken = store.take_due(10, 60_000, "test-releaser")
    error = "publish failed: OperationalError('Error 111 connecting to amqp://u:s3cret@mq:5672//')"
    assert store.give_back(taken, store.now_ms() + 60_000, error + " " + "x" * 200) == [True]

    [item] = invoke_json(app, "delayed", "list")["tasks"]
    assert item["state"] == "pending" and item["attempts"] == 1
    assert "s3cret" not in item["error"] and "amqp://u:**@mq:5672//" in item["error"]
    text = invoke(app, "delayed", "list").stdout
    assert "s3cret" not in text and "publish failed: OperationalError(" in text
    assert "x" * 200 not in text and text.splitlines()[-1].endswith("...")
    shown = invoke(app, "delayed", "show", "invoice-42").stdout
    assert "s3cret" not in shown and "x" * 200 in shown


# -- refusals and errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [["list"], ["show", "k"], ["cancel", "k"], ["reschedule", "k", "+10"], ["count"]],
)
def test_a_sqlite_file_that_is_not_there_is_not_created(tmp_path: Path, args: list[str]) -> None:
    """Where the SQLite file is not there (most likely: another folder than
    beat's), the commands exit 3 saying so, as the claim commands do, rather
    than answer "0 parked"; and they do not create the file."""
    path = tmp_path / "claims.db"
    app = delayed_app(f"sqlite:///{path}")
    result = invoke(app, "delayed", *args)
    assert result.exit_code == EXIT_UNREACHABLE, result.output
    assert "no delayed store" in result.stderr and "does not exist" in result.stderr
    assert not path.exists()


def test_a_bad_delayed_setting_exits_4_naming_it() -> None:
    app = delayed_app(f"{REDIS_URL}?prefix=unused:", anarchon_delayed_lease=0)
    message = fails(app, "delayed", "count", code=EXIT_CONFIG)
    assert "anarchon_delayed_lease must be above 0 seconds" in message


def test_a_bad_setting_exits_4_and_points_to_check() -> None:
    app = delayed_app(f"{REDIS_URL}?prefix=unused:", anarchon_jitter=99)
    message = fails(app, "delayed", "count", code=EXIT_CONFIG)
    assert "anarchon_jitter" in message and "celery -A proj anarchon check" in message


@pytest.mark.parametrize(
    "args", [["list"], ["show", "k"], ["cancel", "k"], ["reschedule", "k", "+5"], ["count"]]
)
def test_an_unreachable_store_is_one_masked_line_and_exit_3(args: list[str]) -> None:
    app = delayed_app("redis://:s3cret@127.0.0.1:1/0")
    message = fails(app, "delayed", *args, code=EXIT_UNREACHABLE)
    assert message.startswith("claim backend unreachable: ") and "s3cret" not in message


def test_bad_arguments_are_usage_errors() -> None:
    """Checked before the store is asked (the backend here is unreachable)."""
    app = delayed_app("redis://127.0.0.1:1/0")
    assert "--before 'soon' is not ISO 8601" in fails(app, "delayed", "list", "--before", "soon")
    assert invoke(app, "delayed", "list", "--limit", "0").exit_code == EXIT_USAGE
    assert invoke(app, "delayed", "reschedule", "k").exit_code == EXIT_USAGE  # no WHEN


# -- the arguments ---------------------------------------------------------------------


def test_parse_when_reads_seconds_from_now_or_an_aware_instant() -> None:
    for text, seconds in (("+90", 90), ("90", 90), ("+1.5", 1.5), (".5", 0.5), ("+0", 0)):
        before = datetime.now(timezone.utc)
        at = parse_when(text)
        after = datetime.now(timezone.utc)
        assert before + timedelta(seconds=seconds) <= at <= after + timedelta(seconds=seconds)
    assert parse_when("2027-01-01T00:00Z") == datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert parse_when(" 2027-01-01T01:00+01:00 ") == datetime(2027, 1, 1, tzinfo=timezone.utc)
    for bad in ("2027-01-01T00:00", "-5", "+", "5m", "next week"):
        with pytest.raises(Fail) as refused:
            parse_when(bad)
        assert refused.value.code == EXIT_USAGE and "WHEN" in refused.value.message


def test_parse_before_reads_an_instant_without_a_zone_as_utc() -> None:
    utc = datetime(2027, 1, 1, tzinfo=timezone.utc)
    assert parse_before("2027-01-01T00:00Z") == utc
    assert parse_before("2027-01-01T00:00") == utc
    assert parse_before("2027-01-01") == utc
    assert parse_before("2027-01-01T03:00+03:00") == utc
    with pytest.raises(Fail) as refused:
        parse_before("yesterday")
    assert refused.value.code == EXIT_USAGE


# -- through Celery's command line ---------------------------------------------------


@pytest.mark.services
def test_the_commands_run_under_celery_a(tmp_path: Path, _redis_cleanup: None) -> None:
    """``celery -A mod anarchon delayed ...`` as an operator runs it: the
    group is registered through the entry point, on the app's settings."""
    require_service("redis")
    url = store_url("redis")
    (tmp_path / "dproj.py").write_text(
        "from celery import Celery\n"
        "app = Celery('dproj', broker='redis://127.0.0.1:6379/1')\n"
        f"app.conf.anarchon_backend = {url!r}\n"
    )
    app = delayed_app(url)
    task_id = delayed.park(app, "dproj.send", ("hello",), countdown=600, key="greeting")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "dproj", "anarchon", "delayed", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        shown = celery("show", "greeting", "--json")
        assert shown.returncode == EXIT_OK, shown.stdout + shown.stderr
        assert json.loads(shown.stdout)["id"] == task_id
        done = celery("cancel", "greeting")
        assert done.returncode == EXIT_OK and "greeting: cancelled" in done.stdout
        again = celery("cancel", "greeting")
        assert again.returncode == EXIT_PROBLEM, again.stdout + again.stderr
        counted = celery("count", "--json")
        assert json.loads(counted.stdout)["count"] == 0
    finally:
        delayed.store_for(app)[0].close()
