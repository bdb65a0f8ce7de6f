"""``import_redbeat`` and ``celery anarchon import redbeat`` on entries that
celery-redbeat itself wrote into a real Redis."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from celery.schedules import crontab, schedule
from click.testing import CliRunner, Result
from redbeat import RedBeatScheduler, RedBeatSchedulerEntry
from redbeat.schedules import rrule

from celery_anarchon.cli import anarchon
from celery_anarchon.importers import import_redbeat
from celery_anarchon.importers.common import (
    ALREADY_IMPORTED,
    IMPORTED,
    NOT_MAPPED,
    SKIPPED,
    WOULD_IMPORT,
)
from celery_anarchon.importers.redbeat import DISABLED_NOTE
from celery_anarchon.schedules import Schedules

from ..beat.support import make_app
from ..conftest import REDIS_URL
from .conftest import redbeat_app

pytestmark = pytest.mark.services

#: A last run of ``every-minute``: its interval's phase, to the second.
LAST_RUN = datetime(2026, 3, 4, 5, 6, 7, 891000, tzinfo=timezone.utc)

CODE = {"code-job": {"task": "t.noop", "schedule": 3600.0}}


def write_entries(old: Celery) -> None:
    """One entry of each kind redbeat keeps, saved with its own API."""
    minute = RedBeatSchedulerEntry(
        "every-minute",
        "proj.sync",
        schedule(timedelta(minutes=1)),
        args=[1, "a"],
        kwargs={"full": False},
        options={"queue": "sync", "priority": 3},
        app=old,
    ).save()
    minute.reschedule(last_run_at=LAST_RUN)
    RedBeatSchedulerEntry(
        "weekdays",
        "proj.report",
        crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"),
        app=old,
    ).save()
    RedBeatSchedulerEntry("off", "proj.off", 30, enabled=False, app=old).save()
    RedBeatSchedulerEntry("rule", "proj.rule", rrule("MINUTELY", count=5), app=old).save()
    RedBeatSchedulerEntry("code-job", "proj.other", 60, app=old).save()
    RedBeatSchedulerEntry("delayed", "proj.d", 60, options={"link": "proj.after"}, app=old).save()


def new_app(tmp_path: Path, prefix: str, **conf: Any) -> Celery:
    """The app moving to celery-anarchon: its code entry, a SQLite store."""
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", CODE, **conf)
    app.conf.update(redbeat_redis_url=REDIS_URL, redbeat_key_prefix=prefix)
    app.conf.timezone = "Europe/Berlin"
    return app


def by_name(report: Any) -> dict[str, Any]:
    return {e.name: e for e in report.entries}


def test_each_kind_is_stored_or_reported_with_its_reason(
    tmp_path: Path, redbeat_prefix: str
) -> None:
    write_entries(redbeat_app(redbeat_prefix))
    app = new_app(tmp_path, redbeat_prefix)
    report = import_redbeat(app)
    got = by_name(report)
    assert {n: e.status for n, e in got.items()} == {
        "every-minute": IMPORTED,
        "weekdays": IMPORTED,
        "off": IMPORTED,
        "rule": NOT_MAPPED,
        "code-job": SKIPPED,
        "delayed": NOT_MAPPED,
    }
    assert not report.ok
    assert "rrule" in got["rule"].reason and "MINUTELY" in got["rule"].source
    assert "beat_schedule entry of this app" in got["code-job"].reason
    assert "unknown option(s) link" in got["delayed"].reason

    with Schedules(app) as schedules:
        state = schedules.state()
        assert sorted(state.jobs) == ["every-minute", "off", "weekdays"]
        minute = state.jobs["every-minute"].definition
        assert (minute.task, minute.schedule, minute.args, minute.kwargs) == (
            "proj.sync",
            {"every": 60.0},
            [1, "a"],
            {"full": False},
        )
        assert minute.options == {"queue": "sync", "priority": 3}
        # The phase of its last run, to the second: slots at :07 past each minute.
        assert minute.anarchon == {"anchor": LAST_RUN.replace(microsecond=0).timestamp()}
        weekdays = state.jobs["weekdays"].definition
        assert weekdays.schedule == {
            "crontab": {
                "minute": "*/15",
                "hour": "9-17",
                "day_of_week": "mon-fri",
                "day_of_month": "*",
                "month_of_year": "*",
            },
            "tz": "Europe/Berlin",
        }
        assert not schedules.get("every-minute").paused
        off = schedules.get("off")
        assert off.paused and off.pause is not None and off.pause.note == DISABLED_NOTE
        assert state.jobs["off"].definition.schedule == {"every": 30.0}


def test_a_second_run_changes_nothing_and_a_taken_name_is_skipped(
    tmp_path: Path, redbeat_prefix: str
) -> None:
    old = redbeat_app(redbeat_prefix)
    write_entries(old)
    app = new_app(tmp_path, redbeat_prefix)
    with Schedules(app) as schedules:
        schedules.add("weekdays", "proj.mine", 5.0)
    import_redbeat(app)
    with Schedules(app) as schedules:
        version = schedules.state().version
    again = by_name(import_redbeat(app))
    assert again["every-minute"].status == ALREADY_IMPORTED
    assert again["off"].status == ALREADY_IMPORTED
    assert again["weekdays"].status == SKIPPED
    assert "stored job with another definition (every 5s, task proj.mine)" in (
        again["weekdays"].reason or ""
    )
    with Schedules(app) as schedules:
        assert schedules.state().version == version
        assert schedules.get("weekdays").definition.task == "proj.mine"  # type: ignore[union-attr]


def test_a_dry_run_writes_nothing_not_even_the_sqlite_file(
    tmp_path: Path, redbeat_prefix: str
) -> None:
    write_entries(redbeat_app(redbeat_prefix))
    app = new_app(tmp_path, redbeat_prefix)
    report = import_redbeat(app, dry_run=True)
    assert by_name(report)["every-minute"].status == WOULD_IMPORT
    assert by_name(report)["delayed"].status == NOT_MAPPED  # validated all the same
    assert "does not exist yet" in report.target
    assert not (tmp_path / "claims.db").exists()


def test_epoch_anchor_and_statics_of_the_old_app(tmp_path: Path, redbeat_prefix: str) -> None:
    """``keep_phase=False`` leaves intervals on the epoch; an entry redbeat
    copied from the old app's beat_schedule stays code, even when the new
    app no longer has it."""
    old = redbeat_app(
        redbeat_prefix,
        beat_schedule={"legacy-static": {"task": "proj.legacy", "schedule": 300.0}},
    )
    RedBeatScheduler(app=old).close()  # copies beat_schedule into Redis, as its beat does
    RedBeatSchedulerEntry("dynamic", "proj.dyn", 120, app=old).save()
    app = new_app(tmp_path, redbeat_prefix)
    got = by_name(import_redbeat(app, keep_phase=False))
    assert got["legacy-static"].status == SKIPPED
    assert "stays a code entry" in (got["legacy-static"].reason or "")
    assert got["dynamic"].status == IMPORTED
    assert got["dynamic"].definition["anarchon"] == {}  # type: ignore[index]
    assert any("from the Unix epoch" in note for note in got["dynamic"].notes)


# -- the command ---------------------------------------------------------------------


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        anarchon,
        ["import", "redbeat", *args],
        obj=CLIContext(app=app, no_color=True, workdir=None),
        catch_exceptions=False,
    )


def test_the_command_takes_redis_and_prefix_and_exits_by_outcome(
    tmp_path: Path, redbeat_prefix: str
) -> None:
    old = redbeat_app(redbeat_prefix)
    RedBeatSchedulerEntry("only", "proj.only", 60, app=old).save()
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", CODE)  # no redbeat_* settings
    args = ("--redis", REDIS_URL, "--key-prefix", redbeat_prefix)

    dry = invoke(app, *args, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    report = json.loads(dry.stdout)
    assert report["dry_run"] and report["counts"]["would_import"] == 1
    assert report["entries"][0]["definition"]["schedule"] == {"every": 60.0}

    done = invoke(app, *args)
    assert done.exit_code == 0, done.output
    assert "imported  only: every 60s (was interval 60.0s)" in done.stdout

    write_entries(old)
    partial = invoke(app, *args)
    assert partial.exit_code == 1, partial.output
    lines = [" ".join(line.split()) for line in partial.stdout.splitlines()]
    assert any(line.startswith("not mapped rule: rrule MINUTELY") for line in lines)
    assert "already imported only: every 60s (was interval 60.0s)" in lines


def test_the_command_exit_codes_for_a_bad_or_dead_source(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'claims.db'}", CODE)
    not_redis = invoke(app, "--redis", "amqp://guest@127.0.0.1//", "--json")
    assert not_redis.exit_code == 2
    assert "is not a Redis URL" in json.loads(not_redis.stdout)["error"]
    dead = invoke(app, "--redis", "redis://:secret@127.0.0.1:1/0")
    assert dead.exit_code == 3
    assert "source unreachable" in dead.stderr and "secret" not in dead.stderr
    empty = invoke(app, "--redis", REDIS_URL, "--key-prefix", "redbeat-test:nothing-here:")
    assert empty.exit_code == 1
    assert "no redbeat entries found there" in empty.stdout
    rabbit = make_app(f"sqlite:///{tmp_path / 'claims.db'}", CODE)
    rabbit.conf.anarchon_backend = "amqp://guest:guest@127.0.0.1:5672//"
    refused = invoke(rabbit, "--redis", REDIS_URL, "--key-prefix", "redbeat-test:nothing-here:")
    assert refused.exit_code == 4
    assert "claim-only" in refused.stderr
