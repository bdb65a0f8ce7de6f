"""Start-up: validation of settings and schedules (every problem named at
once), lazy construction, a missing driver named with its extra."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.checks import run_check
from celery_anarchon.exceptions import ConfigurationError

from ..conftest import require_service
from .support import (
    Unserializable,
    sqlite_app,
)


def test_jitter_must_stay_below_max_late(tmp_path: Path) -> None:
    schedule = {"j": {"task": "proj.j", "schedule": 60.0, "anarchon": {"jitter": 5}}}
    with pytest.raises(ConfigurationError, match="'j'.*jitter.*max_late"):
        Scheduler(sqlite_app(tmp_path, schedule, anarchon_max_late=5))


def test_lazy_construction_connects_nothing(every_second: dict[str, Any], tmp_path: Path) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_backend="redis://127.0.0.1:1/0")
    s = Scheduler(app, lazy=True)
    assert s.backend is None
    assert "anarchon" in s.info
    s.close()
    s.close()


def test_the_banner_of_a_misconfigured_scheduler_names_the_problem_in_one_clause(
    every_second: dict[str, Any], tmp_path: Path
) -> None:
    app = sqlite_app(tmp_path, every_second, anarchon_max_late=-3)
    s = Scheduler(app, lazy=True)
    line = s.info
    assert line.startswith("    . anarchon -> misconfigured (anarchon_max_late"), line
    assert line.endswith("-3), 1 job(s)"), line
    s.close()


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        ("0 0 31 2 *", ["'bad'", "schedule"]),
        ("every day", ["'bad'", "schedule"]),
        (0, ["'bad'"]),
        (-5.0, ["'bad'"]),
        (float("nan"), ["beat_schedule['bad']['schedule']", "interval nan s", "Fix:"]),
        (float("-inf"), ["beat_schedule['bad']['schedule']", "interval -inf s", "Fix:"]),
        (0.001, ["beat_schedule['bad']['schedule']", "below the floor of 0.1 s", "Fix:"]),
        (timedelta(milliseconds=1), ["'bad'", "interval 0.001 s", "Fix:"]),
    ],
)
def test_bad_schedules_are_refused_at_start_up(
    tmp_path: Path, schedule: object, words: list[str]
) -> None:
    app = sqlite_app(tmp_path, {"bad": {"task": "proj.bad", "schedule": schedule}})
    with pytest.raises(ConfigurationError) as err:
        Scheduler(app)
    for word in words:
        assert word in str(err.value)


def test_an_entry_without_a_task_is_refused_with_checks_message(tmp_path: Path) -> None:
    """Issue 12, item 5: beat published such an entry with ``task=None``
    (79 messages in 15 s) although ``check`` refused it."""
    app = sqlite_app(tmp_path, {"taskless": {"schedule": 1.0}})
    [problem] = run_check(app, None, False).problems
    with pytest.raises(ConfigurationError) as err:
        Scheduler(app)
    assert problem["message"] in str(err.value)
    assert "beat_schedule['taskless']: no 'task'" in str(err.value)


def test_args_that_are_not_a_list_stop_beat_with_checks_message(tmp_path: Path) -> None:
    """``'args': 5`` crashed ``check`` with a traceback and stopped beat
    with Celery's bare ``'int' object is not iterable``, naming no job."""
    app = sqlite_app(tmp_path, {"tick": {"task": "proj.t", "schedule": 1.0, "args": 5}})
    [problem] = run_check(app, None, False).problems
    with pytest.raises(ConfigurationError) as err:
        Scheduler(app)
    assert problem["message"] in str(err.value)
    assert "beat_schedule['tick']['args']: expected a list or tuple, got 5" in str(err.value)


def test_args_the_serializer_refuses_are_logged_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12, item 1: beat logs the problem ``check`` reports, and runs
    the other jobs (the bad one's slots are each recorded lost)."""
    schedule = {
        "nonjson": {"task": "proj.t", "schedule": 1.0, "args": [Unserializable()]},
        "good": {"task": "proj.t", "schedule": 1.0},
    }
    app = sqlite_app(tmp_path, schedule)
    [problem] = run_check(app, None, False).problems
    with caplog.at_level(logging.ERROR, logger="celery_anarchon"):
        s = Scheduler(app)
    try:
        assert set(s.jobs) == {"nonjson", "good"}
        assert problem["message"] in caplog.text
    finally:
        s.close()


def test_unknown_per_entry_key_is_refused(tmp_path: Path) -> None:
    schedule = {"sync": {"task": "proj.sync", "schedule": 5.0, "anarchon": {"jiter": 0}}}
    with pytest.raises(ConfigurationError, match="'sync'.*jiter"):
        Scheduler(sqlite_app(tmp_path, schedule))


def test_start_up_names_every_bad_entry_at_once(tmp_path: Path) -> None:
    schedule = {
        "typo": {"task": "t", "schedul": 5.0},
        "hour25": {"task": "t", "schedule": "*/15 25 * * *"},
        "jiter": {"task": "t", "schedule": 5.0, "anarchon": {"jiter": 1}},
    }
    with pytest.raises(ConfigurationError) as err:
        Scheduler(sqlite_app(tmp_path, schedule))
    message = str(err.value)
    assert "3 configuration problem(s)" in message
    for words in ("'typo'", "Did you mean 'schedule'", "'hour25'", "hour 0-23", "'jiter'"):
        assert words in message


def test_a_missing_database_driver_names_the_extra(
    tmp_path: Path, every_second: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver is installed here, so hide it: the one failure a real
    # install cannot show on this machine.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a)
    )
    app = sqlite_app(tmp_path, every_second, anarchon_backend="postgresql://db/proj")
    with pytest.raises(ConfigurationError, match=r"psycopg.*celery-anarchon\[postgres\]"):
        Scheduler(app)


def test_a_schedule_of_the_wrong_type_names_the_job(tmp_path: Path) -> None:
    schedule = {"listed": {"task": "t", "schedule": [5]}}
    with pytest.raises(ConfigurationError, match=r"'listed'.*\[5\] is not a schedule"):
        Scheduler(sqlite_app(tmp_path, schedule))


@pytest.mark.services
def test_a_postgresql_role_that_does_not_exist_stops_beat_at_start_up(tmp_path: Path) -> None:
    """Issue 12, item 6: refused at start-up as a configuration error (with
    the masked URL), not retried for ever as an outage."""
    require_service("postgresql")
    role = f"nobody_{uuid.uuid4().hex[:8]}"
    url = f"postgresql://{role}:s3cret@127.0.0.1:5432/test"
    app = sqlite_app(tmp_path, {"j": {"task": "proj.j", "schedule": 5.0}}, anarchon_backend=url)
    with pytest.raises(ConfigurationError) as err:
        Scheduler(app)
    assert f'role "{role}" does not exist' in str(err.value)
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("good", [True, False], ids=["set-up done", "set-up refused"])
@pytest.mark.parametrize("enabled", [True, False], ids=["collector on", "collector off"])
def test_set_up_leaves_the_garbage_collector_as_it_found_it(
    tmp_path: Path, every_second: dict[str, Any], good: bool, enabled: bool
) -> None:
    """Set-up turns the cyclic collector off while it builds the jobs; it
    must come back on, or stay off, as it was, also when set-up fails."""
    import gc

    schedule = every_second if good else {"j": {"task": "proj.j", "schedule": "not cron"}}
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        if good:
            s = Scheduler(sqlite_app(tmp_path, schedule))
            s.close()
        else:
            with pytest.raises(ConfigurationError):
                Scheduler(sqlite_app(tmp_path, schedule))
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("form", ["ScheduleEntry", "pairs"])
def test_beat_schedule_values_celery_accepts_start_beat(tmp_path: Path, form: str) -> None:
    """Celery's merge takes any value ``dict()`` takes (a ``ScheduleEntry``,
    a list of pairs): so does beat, reading the clock once for all."""
    from celery import beat

    fields = {"task": "proj.j", "schedule": 60.0}
    app = sqlite_app(tmp_path, {})
    value: Any = (
        beat.ScheduleEntry(name="j", app=app, **fields)
        if form == "ScheduleEntry"
        else list(fields.items())
    )
    app.conf.beat_schedule = {"j": value}
    s = Scheduler(app)
    try:
        assert "j" in s.jobs and s.jobs["j"].entry.task == "proj.j"
    finally:
        s.close()
