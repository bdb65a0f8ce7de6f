"""What the importers' tests share: the old schedulers' stores, written with
the real packages' own APIs.

* redbeat: a Redis key prefix of the test's own (deleted afterwards) and an
  "old app" configured for it, on which ``RedBeatSchedulerEntry(...).save()``
  writes entries as celery-redbeat does;
* django-celery-beat: Django configured once per test process, its
  migrations run on a SQLite file (the ORM's default database) and, for the
  tests that need it, on a PostgreSQL schema of the run's own (alias
  ``"pg"``), rows created with its models.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from ..conftest import POSTGRES_URL, REDIS_URL, RUN_ID, require_service

#: One instant for every row a test makes, whole seconds (UTC): the rows of
#: the SQLite and PostgreSQL databases then map to the same definitions.
NOW = datetime.now(timezone.utc).replace(microsecond=0)

#: The PostgreSQL schema that holds this process's django-celery-beat tables.
PG_SCHEMA = f"dcb_{RUN_ID}_{os.getpid()}"


@pytest.fixture
def redbeat_prefix() -> Iterator[str]:
    """A redbeat key prefix of this test's own; its keys are deleted after."""
    require_service("redis")
    import redis

    prefix = f"redbeat-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        client.delete(key)
    client.close()


def redbeat_app(prefix: str, **conf: Any) -> Celery:
    """The app celery-redbeat ran with: its Redis and key prefix."""
    app = Celery(f"old-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        redbeat_redis_url=REDIS_URL,
        redbeat_key_prefix=prefix,
        timezone="Europe/Berlin",
        **conf,
    )
    return app


@dataclass(frozen=True)
class DjangoDatabases:
    """Where django-celery-beat's tables are.

    Attributes:
        sqlite_path: the ORM's default database (a SQLite file).
    """

    sqlite_path: Path

    @property
    def sqlite_url(self) -> str:
        return f"sqlite:///{self.sqlite_path}"


def _pg_settings() -> dict[str, Any]:
    import sqlalchemy as sa

    url = sa.engine.make_url(POSTGRES_URL)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.database,
        "USER": url.username or "postgres",
        "PASSWORD": url.password or "",
        "HOST": url.host or "127.0.0.1",
        "PORT": url.port or 5432,
        "OPTIONS": {"options": f"-c search_path={PG_SCHEMA}"},
    }


@pytest.fixture(scope="session")
def django_databases(tmp_path_factory: pytest.TempPathFactory) -> DjangoDatabases:
    """Django configured with django_celery_beat, migrated on SQLite."""
    import django
    from django.conf import settings
    from django.core.management import call_command

    path = tmp_path_factory.mktemp("django") / "django.sqlite3"
    settings.configure(
        INSTALLED_APPS=["django_celery_beat"],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path)},
            "pg": _pg_settings(),
        },
        USE_TZ=True,
        TIME_ZONE="UTC",
    )
    django.setup()
    call_command("migrate", "django_celery_beat", verbosity=0)
    return DjangoDatabases(path)


@pytest.fixture(scope="session")
def django_pg_url(django_databases: DjangoDatabases) -> Iterator[str]:
    """django-celery-beat's tables migrated into a PostgreSQL schema of
    this process's own (dropped afterwards); its SQLAlchemy URL."""
    require_service("postgresql")
    import psycopg
    from django.core.management import call_command
    from django.db import connections

    conninfo = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{PG_SCHEMA}"')
    try:
        call_command("migrate", "django_celery_beat", database="pg", verbosity=0)
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{PG_SCHEMA}"
    finally:
        connections["pg"].close()
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{PG_SCHEMA}" CASCADE')


def clear_rows(db: str = "default") -> None:
    """Delete every django-celery-beat row of ``db``."""
    from django_celery_beat import models

    for model in (
        models.PeriodicTask,
        models.IntervalSchedule,
        models.CrontabSchedule,
        models.SolarSchedule,
        models.ClockedSchedule,
    ):
        model.objects.using(db).all().delete()


def add_task(db: str, name: str, task: str, **fields: Any) -> Any:
    """Save a ``PeriodicTask`` on ``db`` as the admin would."""
    from django_celery_beat.models import PeriodicTask

    row = PeriodicTask(name=name, task=task, **fields)
    row.save(using=db)
    return row


def make_rows(db: str = "default") -> None:
    """The rows every django-celery-beat test imports (after clearing ``db``).

    One of each schedule kind and of each field that maps, and one of each
    case that does not: a clocked time and an expiry in the past, a name a
    code entry has (``hourly``), Celery's own clean-up entry.
    """
    from django_celery_beat import models

    clear_rows(db)
    interval = models.IntervalSchedule.objects.db_manager(db)
    cron = models.CrontabSchedule.objects.db_manager(db)
    clocked = models.ClockedSchedule.objects.db_manager(db)
    every_10m = interval.create(every=10, period="minutes")
    every_30s = interval.create(every=30, period="seconds")
    hourly = interval.create(every=1, period="hours")
    nightly = cron.create(
        minute="30",
        hour="2",
        day_of_week="1-5",
        day_of_month="*",
        month_of_year="*",
        timezone=ZoneInfo("America/New_York"),
    )
    add_task(
        db,
        "export",
        "proj.export",
        interval=every_10m,
        args='[1, "a"]',
        kwargs='{"full": false}',
        queue="reports",
        exchange="exports",
        routing_key="exports.daily",
        priority=5,
        headers='{"trace": "on"}',
        expire_seconds=30,
        start_time=NOW + timedelta(days=1, minutes=3),
    )
    add_task(db, "nightly", "proj.report", crontab=nightly, expires=NOW + timedelta(days=30))
    sunrise = models.SolarSchedule.objects.db_manager(db).create(
        event="sunrise", latitude=52.5, longitude=13.4
    )
    add_task(db, "sunrise", "proj.lights", solar=sunrise)
    launch = clocked.create(clocked_time=NOW + timedelta(days=2))
    add_task(db, "launch", "proj.launch", clocked=launch, one_off=True)
    past = clocked.create(clocked_time=NOW - timedelta(days=1))
    add_task(db, "launched", "proj.launch", clocked=past, one_off=True)
    add_task(db, "once", "proj.once", interval=hourly, one_off=True)
    add_task(db, "frozen", "proj.frozen", crontab=nightly, enabled=False)
    add_task(db, "gone", "proj.gone", interval=hourly, expires=NOW - timedelta(hours=1))
    add_task(db, "hourly", "proj.code", interval=hourly)
    add_task(db, "celery.backend_cleanup", "celery.backend_cleanup", crontab=nightly)
    add_task(db, "ticking", "proj.tick", interval=every_30s, last_run_at=LAST_RUN)


#: The ``last_run_at`` of the row ``ticking``: its interval's phase.
LAST_RUN = datetime(2026, 1, 1, 12, 0, 7, 345000, tzinfo=timezone.utc)
