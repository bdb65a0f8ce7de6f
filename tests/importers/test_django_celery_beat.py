"""``import_django_celery_beat`` and ``celery anarchon import
django-celery-beat`` on rows made with django-celery-beat's own models, read
through Django's ORM (SQLite) and straight from the tables (SQLite and
PostgreSQL): both ways give the same stored jobs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_anarchon.cli import anarchon
from celery_anarchon.importers import import_django_celery_beat
from celery_anarchon.importers.common import IMPORTED, NOT_MAPPED, SKIPPED, WOULD_IMPORT
from celery_anarchon.importers.django import DISABLED_NOTE
from celery_anarchon.schedules import Schedules
from celery_anarchon.slots import to_ms
from celery_anarchon.stored import _iso_ms

from ..beat.support import make_app
from ..beats import REPO
from .conftest import LAST_RUN, NOW, DjangoDatabases, clear_rows, make_rows

CODE = {"hourly": {"task": "t.noop", "schedule": 3600.0}}

EXPECTED_STATUS = {
    "export": IMPORTED,
    "nightly": IMPORTED,
    "sunrise": IMPORTED,
    "launch": IMPORTED,
    "launched": NOT_MAPPED,
    "once": IMPORTED,
    "frozen": IMPORTED,
    "gone": NOT_MAPPED,
    "hourly": SKIPPED,
    "celery.backend_cleanup": SKIPPED,
    "ticking": IMPORTED,
}


def iso(at: Any) -> str:
    return _iso_ms(to_ms(at))


def new_app(tmp_path: Path) -> Celery:
    return make_app(f"sqlite:///{tmp_path / 'claims.db'}", CODE)


def outcome(report: Any) -> dict[str, tuple[str, Any, bool]]:
    """``{name: (status, definition, paused)}``, a dry run's would-import
    counted as imported."""
    return {
        e.name: (IMPORTED if e.status == WOULD_IMPORT else e.status, e.definition, e.paused)
        for e in report.entries
    }


def test_every_field_maps_through_the_orm(
    tmp_path: Path, django_databases: DjangoDatabases
) -> None:
    make_rows()
    app = new_app(tmp_path)
    report = import_django_celery_beat(app)
    got = {e.name: e for e in report.entries}
    assert {n: e.status for n, e in got.items()} == EXPECTED_STATUS
    assert report.read_from.startswith("Django ORM")
    assert "has passed" in (got["launched"].reason or "")
    assert "expired at" in (got["gone"].reason or "")
    assert "beat_schedule entry of this app" in (got["hourly"].reason or "")
    assert "Celery's own result clean-up entry" in (got["celery.backend_cleanup"].reason or "")

    with Schedules(app) as schedules:
        jobs = {name: job.definition for name, job in schedules.state().jobs.items()}
        assert sorted(jobs) == sorted(n for n, s in EXPECTED_STATUS.items() if s == IMPORTED)
        export = jobs["export"]
        start = NOW + timedelta(days=1, minutes=3)
        assert (export.task, export.schedule, export.args, export.kwargs) == (
            "proj.export",
            {"every": 600.0},
            [1, "a"],
            {"full": False},
        )
        assert export.options == {
            "queue": "reports",
            "exchange": "exports",
            "routing_key": "exports.daily",
            "priority": 5,
            "headers": {"trace": "on"},
            "expires": 30,
        }
        # Never ran: its phase is its start time; no slot before it.
        assert export.anarchon == {"anchor": start.timestamp(), "start_at": iso(start)}
        nightly = jobs["nightly"]
        assert nightly.schedule["tz"] == "America/New_York"
        assert nightly.schedule["crontab"]["day_of_week"] == "1-5"
        # django-celery-beat sends nothing at or after expires; end_at is inclusive.
        assert nightly.anarchon == {
            "end_at": iso(NOW + timedelta(days=30) - timedelta(milliseconds=1))
        }
        assert jobs["sunrise"].schedule == {"solar": "sunrise", "lat": 52.5, "lon": 13.4}
        assert jobs["launch"].schedule == {"at": iso(NOW + timedelta(days=2))}
        assert jobs["launch"].anarchon == {}  # runs once by itself
        assert jobs["once"].anarchon["max_runs"] == 1
        assert jobs["ticking"].anarchon == {"anchor": LAST_RUN.replace(microsecond=0).timestamp()}
        frozen = schedules.get("frozen")
        assert frozen.paused and frozen.pause is not None and frozen.pause.note == DISABLED_NOTE
        assert not schedules.get("export").paused


def test_the_tables_read_directly_give_what_the_orm_gives(
    tmp_path: Path, django_databases: DjangoDatabases
) -> None:
    make_rows()
    through_orm = outcome(import_django_celery_beat(new_app(tmp_path)))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    direct = import_django_celery_beat(new_app(fresh), django_databases.sqlite_url, dry_run=True)
    assert outcome(direct) == through_orm
    assert not (fresh / "claims.db").exists()


@pytest.mark.services
def test_postgresql_through_database_url(
    tmp_path: Path, django_databases: DjangoDatabases, django_pg_url: str
) -> None:
    make_rows()
    expected = outcome(import_django_celery_beat(new_app(tmp_path)))
    clear_rows()  # django-celery-beat checks a new row's name on the default database
    make_rows("pg")
    (tmp_path / "pg").mkdir()
    app = new_app(tmp_path / "pg")
    result = invoke(app, "--database-url", django_pg_url, "--json")
    assert result.exit_code == 1, result.output  # launched, gone, hourly, cleanup
    report = json.loads(result.stdout)
    got = {e["name"]: (e["status"], e["definition"], e["paused"]) for e in report["entries"]}
    assert got == expected
    assert "secret" not in report["read_from"]
    with Schedules(app) as schedules:
        assert schedules.get("frozen").paused


# -- the command ---------------------------------------------------------------------


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        anarchon,
        ["import", "django-celery-beat", *args],
        obj=CLIContext(app=app, no_color=True, workdir=None),
        catch_exceptions=False,
    )


def test_the_command_prints_each_outcome(tmp_path: Path, django_databases: DjangoDatabases) -> None:
    make_rows()
    app = new_app(tmp_path)
    dry = invoke(app, "--dry-run")
    assert dry.exit_code == 1, dry.output
    lines = [" ".join(line.split()) for line in dry.stdout.splitlines()]
    assert "dry run: nothing written" in lines
    assert any(line.startswith("would import frozen: crontab '30 2 * * 1-5'") for line in lines)
    assert any(line.startswith("not mapped gone:") for line in lines)
    assert lines[-1] == "7 would import, 2 skipped, 2 not mapped"
    with Schedules(app) as schedules:
        assert schedules.state().jobs == {}


def run_celery(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.beat_app anarchon import django-celery-beat ARGS`` in
    a process of its own, without Django settings."""
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(
        PYTHONPATH=str(REPO),
        ITEST_BACKEND=f"sqlite:///{tmp_path / 'claims.db'}",
        ITEST_CONF=json.dumps({"beat_schedule": CODE}),
    )
    command = [sys.executable, "-m", "celery", "-A", "tests.beat_app", "anarchon", "import"]
    return subprocess.run(
        [*command, "django-celery-beat", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_real_command_without_django_settings(
    tmp_path: Path, django_databases: DjangoDatabases
) -> None:
    make_rows()
    unconfigured = run_celery(tmp_path)
    assert unconfigured.returncode == 2, unconfigured.stderr
    assert "Django is not configured" in unconfigured.stderr
    assert "--database-url" in unconfigured.stderr
    no_file = run_celery(tmp_path, "--database-url", f"sqlite:///{tmp_path / 'nope.db'}")
    assert no_file.returncode == 2 and "no SQLite file" in no_file.stderr
    assert not (tmp_path / "nope.db").exists()
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    no_tables = run_celery(tmp_path, "--database-url", f"sqlite:///{empty}")
    assert no_tables.returncode == 2
    assert "no table django_celery_beat_periodictask" in no_tables.stderr
    done = run_celery(tmp_path, "--database-url", django_databases.sqlite_url, "--json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert {e["name"]: e["status"] for e in report["entries"]} == EXPECTED_STATUS
    assert report["exit_code"] == 1
