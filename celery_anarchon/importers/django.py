"""Import django-celery-beat's ``PeriodicTask`` rows as stored jobs.

Two ways to read them, giving the same rows:

* through Django's ORM, when Django is configured in this process
  (``DJANGO_SETTINGS_MODULE``, as a Django project's Celery app sets it)
  and ``django_celery_beat`` is installed there;
* straight from its tables with SQLAlchemy, given the database's URL:
  ``django_celery_beat_periodictask`` and the schedule tables it points to
  (``_intervalschedule``, ``_crontabschedule``, ``_solarschedule``,
  ``_clockedschedule``), columns as its migrations create them
  (``django_celery_beat/migrations``). Columns added by later migrations
  (``headers``, ``priority``, ``clocked_id``, ``expire_seconds``) may be
  missing from an old schema.

Mapping (docs/migrating-django-celery-beat.md):

======================  ===============================================
django-celery-beat      stored job
======================  ===============================================
IntervalSchedule        seconds; anchored on the last run (else on
                        ``start_time``) so the phase stays, else on the
                        epoch; ``keep_phase=False``: on the epoch
CrontabSchedule         the same crontab, in its ``timezone``
SolarSchedule           the same solar schedule
ClockedSchedule         its aware datetime (one run)
args, kwargs (JSON)     args, kwargs
queue, exchange,        options of the same names
routing_key, priority,
headers
expire_seconds          ``options['expires']`` (seconds from the send)
expires                 ``end_at`` = ``expires`` - 1 ms (it stopped
                        at ``expires``; ``end_at`` is inclusive)
start_time              ``start_at``
one_off                 ``max_runs=1`` (a clocked task runs once anyway)
enabled False           stored paused, note ``imported from
                        django-celery-beat: disabled``
======================  ===============================================
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import crontab, solar

from ..backends import SCHEMES, sanitize_url, scheme_of
from ..model import app_zone
from ..stored import CRONTAB_FIELDS
from .common import ImportReport, ImportSourceError, Mapped, SourceUnavailable, iso, store

__all__ = [
    "BACKEND_CLEANUP",
    "DISABLED_NOTE",
    "TABLE_PREFIX",
    "PeriodicTaskRow",
    "import_django_celery_beat",
    "map_row",
    "rows_from_database",
    "rows_from_orm",
]

#: The pause note of a row that was disabled.
DISABLED_NOTE = "imported from django-celery-beat: disabled"

#: Celery's own result clean-up entry, which beat installs by itself.
BACKEND_CLEANUP = "celery.backend_cleanup"

#: The tables' names start with this (Django's ``<app label>_<model>``).
TABLE_PREFIX = "django_celery_beat_"

#: ``IntervalSchedule.period`` -> seconds in one period.
PERIOD_SECONDS = {
    "days": 86400.0,
    "hours": 3600.0,
    "minutes": 60.0,
    "seconds": 1.0,
    "microseconds": 1e-6,
}


@dataclass(frozen=True)
class PeriodicTaskRow:
    """One ``PeriodicTask`` row with its schedule, however it was read.

    Datetimes are aware. Exactly one of ``interval``, ``crontab``,
    ``solar`` and ``clocked`` is set in a row django-celery-beat saved.

    Attributes:
        name, task, args, kwargs, queue, exchange, routing_key, priority,
        headers, expires, expire_seconds, one_off, start_time, enabled,
        last_run_at, total_run_count: the row's columns (``args``,
            ``kwargs``, ``headers``: the JSON texts).
        interval: ``(every, period)``, or None.
        crontab: the five fields and ``timezone`` (an IANA name, or None
            when crontabs ignore zones: ``DJANGO_CELERY_BEAT_TZ_AWARE =
            False``), or None.
        solar: ``(event, latitude, longitude)``, or None.
        clocked: the clocked time, or None.
    """

    name: str
    task: str
    args: str | None = "[]"
    kwargs: str | None = "{}"
    queue: str | None = None
    exchange: str | None = None
    routing_key: str | None = None
    priority: int | None = None
    headers: str | None = "{}"
    expires: datetime | None = None
    expire_seconds: int | None = None
    one_off: bool = False
    start_time: datetime | None = None
    enabled: bool = True
    last_run_at: datetime | None = None
    total_run_count: int = 0
    interval: tuple[int, str] | None = None
    crontab: Mapping[str, Any] | None = None
    solar: tuple[str, float, float] | None = None
    clocked: datetime | None = None


def import_django_celery_beat(
    app: Any,
    database_url: str | None = None,
    *,
    dry_run: bool = False,
    keep_phase: bool = True,
    schedule_filename: str | None = None,
) -> ImportReport:
    """Store django-celery-beat's periodic tasks as stored jobs of ``app``.

    Args:
        app: the Celery app (its claim backend keeps the stored jobs).
        database_url: the Django database's URL (``postgresql://``,
            ``mysql://``, ``sqlite:///path``); its tables are read with
            SQLAlchemy, naive times as UTC (Django's ``USE_TZ = True``).
            None: through Django's ORM, which must be configured.
        dry_run: write nothing; report what would be stored.
        keep_phase: anchor an interval on its last run (or start time), so
            it keeps the phase it had (False: on the Unix epoch).
        schedule_filename: beat's ``-s`` file, when the default SQLite
            backend is used with another file than the default.
    Returns:
        the report: one result per row.
    Raises:
        ImportSourceError: no URL and Django not configured, or
            django_celery_beat not installed there; a database without its
            tables; a URL that is not a SQL URL.
        SourceUnavailable: the database did not answer.
        StoredJobsRefused: the claim backend is claim-only (RabbitMQ).
        BackendUnavailable: the claim backend did not answer.
    """
    if database_url is not None:
        rows = rows_from_database(database_url)
        where = sanitize_url(database_url)
    else:
        rows, where = rows_from_orm()
    zone = app_zone(app)
    now_ms = int(time.time() * 1000)
    mapped = [map_row(row, zone, keep_phase=keep_phase, now_ms=now_ms) for row in rows]
    return store(
        app,
        mapped,
        source="django-celery-beat",
        read_from=where,
        dry_run=dry_run,
        schedule_filename=schedule_filename,
    )


# -- reading --------------------------------------------------------------------


def _aware(value: Any, zone: tzinfo = timezone.utc) -> Any:
    """``value`` in ``zone`` when it is a naive datetime, else unchanged."""
    if isinstance(value, datetime) and value.utcoffset() is None:
        return value.replace(tzinfo=zone)
    return value


def rows_from_orm() -> tuple[list[PeriodicTaskRow], str]:
    """Every ``PeriodicTask`` through Django's ORM (the default database),
    and a description of where they came from.

    Raises:
        ImportSourceError: Django is not installed or configured, or
            django_celery_beat is not in ``INSTALLED_APPS``, or its tables
            are missing.
        SourceUnavailable: the database did not answer.
    """
    try:
        import django
        from django.conf import settings
    except ImportError:
        raise ImportSourceError(
            "Django is not installed here: pass --database-url with the URL of the database "
            "that holds django-celery-beat's tables."
        ) from None
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ImportSourceError(
            "Django is not configured (no DJANGO_SETTINGS_MODULE): run the command with the "
            "project's settings, or pass --database-url with the URL of the database that "
            "holds django-celery-beat's tables."
        )
    django.setup()
    from django.apps import apps
    from django.db import DatabaseError, connection
    from django.utils import timezone as django_timezone

    if not apps.is_installed("django_celery_beat"):
        raise ImportSourceError(
            "django_celery_beat is not in INSTALLED_APPS of the Django settings here: pass "
            "--database-url with the URL of the database that holds its tables."
        )
    from django_celery_beat.models import PeriodicTask

    where = f"Django ORM, database {connection.settings_dict.get('NAME')!s}"
    naive_zone = django_timezone.get_default_timezone() if not settings.USE_TZ else timezone.utc
    crontab_zones = getattr(settings, "DJANGO_CELERY_BEAT_TZ_AWARE", True)
    try:
        if PeriodicTask._meta.db_table not in connection.introspection.table_names():
            raise ImportSourceError(
                f"the database {where} has no django-celery-beat tables: run "
                "`manage.py migrate django_celery_beat`, or give --database-url."
            )
        tasks = list(
            PeriodicTask.objects.select_related("interval", "crontab", "solar", "clocked").order_by(
                "name"
            )
        )
    except DatabaseError as exc:
        raise SourceUnavailable(f"{where} did not answer: {exc}") from exc

    def aware(value: Any) -> Any:
        return _aware(value, naive_zone)

    rows = []
    for t in tasks:
        c = t.crontab
        rows.append(
            PeriodicTaskRow(
                name=t.name,
                task=t.task,
                args=t.args,
                kwargs=t.kwargs,
                queue=t.queue,
                exchange=t.exchange,
                routing_key=t.routing_key,
                priority=t.priority,
                headers=t.headers,
                expires=aware(t.expires),
                expire_seconds=t.expire_seconds,
                one_off=bool(t.one_off),
                start_time=aware(t.start_time),
                enabled=bool(t.enabled),
                last_run_at=aware(t.last_run_at),
                total_run_count=int(t.total_run_count or 0),
                interval=(t.interval.every, t.interval.period) if t.interval else None,
                crontab=(
                    {
                        **{f: getattr(c, f) for f in CRONTAB_FIELDS},
                        "timezone": str(c.timezone) if crontab_zones else None,
                    }
                    if c
                    else None
                ),
                solar=(
                    (t.solar.event, float(t.solar.latitude), float(t.solar.longitude))
                    if t.solar
                    else None
                ),
                clocked=aware(t.clocked.clocked_time) if t.clocked else None,
            )
        )
    return rows, where


def rows_from_database(url: str) -> list[PeriodicTaskRow]:
    """Every ``PeriodicTask`` row, read from the tables at ``url`` with
    SQLAlchemy. Naive times are taken as UTC (what Django stores with
    ``USE_TZ = True``, its default).

    Raises:
        ImportSourceError: not a SQL URL, a SQLite file that is not there,
            or no ``django_celery_beat_periodictask`` table.
        SourceUnavailable: the database did not answer.
    """
    import sqlalchemy as sa

    engine = sa.create_engine(_sqlalchemy_url(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            tables = _reflect(conn, url)
            return _read_rows(conn, tables)
    except sa.exc.DBAPIError as exc:
        raise SourceUnavailable(
            f"the database at {sanitize_url(url)} did not answer: {exc.orig}"
        ) from exc
    finally:
        engine.dispose()


def _sqlalchemy_url(url: str) -> Any:
    """``url`` with the driver SQLAlchemy needs (``postgres://`` as psycopg 3).

    Raises:
        ImportSourceError: not a SQL URL, or a SQLite file that is not there.
    """
    import sqlalchemy as sa

    scheme = SCHEMES.get(scheme_of(url))
    if scheme is None or scheme.sqlalchemy is None:
        raise ImportSourceError(
            f"--database-url {sanitize_url(url)!r} is not a SQL URL: give postgresql://, "
            "mysql:// or sqlite:///PATH, the database of the Django project."
        )
    parsed = sa.engine.make_url(url).set(drivername=scheme.sqlalchemy)
    if scheme.sqlalchemy == "sqlite" and not Path(parsed.database or "").is_file():
        raise ImportSourceError(
            f"--database-url {sanitize_url(url)!r}: no SQLite file {parsed.database!r}."
        )
    return parsed


def _reflect(conn: Any, url: str) -> dict[str, Any]:
    """The tables there is (by model name), read from the database."""
    import sqlalchemy as sa

    inspector = sa.inspect(conn)
    metadata = sa.MetaData()
    names = ("periodictask", "intervalschedule", "crontabschedule", "solarschedule")
    tables = {}
    for model in (*names, "clockedschedule"):
        if inspector.has_table(TABLE_PREFIX + model):
            tables[model] = sa.Table(TABLE_PREFIX + model, metadata, autoload_with=conn)
    if "periodictask" not in tables:
        raise ImportSourceError(
            f"the database at {sanitize_url(url)} has no table "
            f"{TABLE_PREFIX}periodictask: is it the Django project's database, migrated "
            "(`manage.py migrate django_celery_beat`)?"
        )
    return tables


def _by_id(conn: Any, table: Any, build: Callable[[Any], Any]) -> dict[Any, Any]:
    if table is None:
        return {}
    return {row.id: build(row) for row in conn.execute(table.select())}


def _read_rows(conn: Any, tables: dict[str, Any]) -> list[PeriodicTaskRow]:
    intervals = _by_id(conn, tables.get("intervalschedule"), lambda r: (int(r.every), r.period))
    crontabs = _by_id(
        conn,
        tables.get("crontabschedule"),
        lambda r: {
            **{f: getattr(r, f) for f in CRONTAB_FIELDS},
            "timezone": getattr(r, "timezone", None) or "UTC",
        },
    )
    solars = _by_id(
        conn,
        tables.get("solarschedule"),
        lambda r: (r.event, float(r.latitude), float(r.longitude)),
    )
    clockeds = _by_id(conn, tables.get("clockedschedule"), lambda r: _aware(r.clocked_time))
    table = tables["periodictask"]
    rows = []
    for r in conn.execute(table.select().order_by(table.c.name)):
        m = r._mapping

        def col(name: str, default: Any = None, m: Any = m) -> Any:
            return m.get(name, default)

        rows.append(
            PeriodicTaskRow(
                name=m["name"],
                task=m["task"],
                args=col("args"),
                kwargs=col("kwargs"),
                queue=col("queue"),
                exchange=col("exchange"),
                routing_key=col("routing_key"),
                priority=col("priority"),
                headers=col("headers"),
                expires=_aware(col("expires")),
                expire_seconds=col("expire_seconds"),
                one_off=bool(col("one_off", False)),
                start_time=_aware(col("start_time")),
                enabled=bool(col("enabled", True)),
                last_run_at=_aware(col("last_run_at")),
                total_run_count=int(col("total_run_count", 0) or 0),
                interval=intervals.get(col("interval_id")),
                crontab=crontabs.get(col("crontab_id")),
                solar=solars.get(col("solar_id")),
                clocked=clockeds.get(col("clocked_id")),
            )
        )
    return rows


# -- mapping --------------------------------------------------------------------


def map_row(row: PeriodicTaskRow, zone: ZoneInfo, *, keep_phase: bool, now_ms: int) -> Mapped:
    """One ``PeriodicTask`` row as a stored job (or the reason it cannot be one).

    Args:
        row: the row.
        zone: the app's zone (a crontab without a zone of its own ran in it).
        keep_phase: anchor an interval on its last run, else its start time.
        now_ms: now, epoch ms: a clocked time before it is not imported.
    """
    mapped = Mapped(row.name, describe_source(row), task=row.task)
    if row.name == BACKEND_CLEANUP:
        mapped.skip = (
            "Celery's own result clean-up entry: beat adds it by itself when result_expires is set"
        )
        return mapped
    kinds = [k for k in ("interval", "crontab", "solar", "clocked") if getattr(row, k) is not None]
    if len(kinds) != 1:
        mapped.problem = (
            "no schedule set"
            if not kinds
            else f"more than one schedule set ({', '.join(kinds)}): django-celery-beat refuses "
            "such a row on save; keep one"
        )
        return mapped
    try:
        mapped.args = json.loads(row.args or "[]")
        mapped.kwargs = json.loads(row.kwargs or "{}")
        headers = json.loads(row.headers or "{}")
    except ValueError as exc:
        mapped.problem = f"args, kwargs or headers are not JSON ({exc})"
        return mapped
    mapped.options = _options(row, headers)
    {
        "interval": _interval,
        "crontab": _crontab,
        "solar": _solar,
        "clocked": _clocked,
    }[kinds[0]](mapped, row, zone, keep_phase, now_ms)
    if mapped.problem is None:
        _bounds(mapped, row, now_ms)
    return mapped


def _options(row: PeriodicTaskRow, headers: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key in ("queue", "exchange", "routing_key"):
        value = getattr(row, key)
        if value:
            options[key] = value
    if row.priority is not None:
        options["priority"] = int(row.priority)
    if headers:
        options["headers"] = headers
    if row.expire_seconds is not None:
        options["expires"] = int(row.expire_seconds)
    return options


def _interval(
    mapped: Mapped, row: PeriodicTaskRow, zone: ZoneInfo, keep_phase: bool, now_ms: int
) -> None:
    assert row.interval is not None
    every, period = row.interval
    if period not in PERIOD_SECONDS:
        mapped.problem = f"unknown interval period {period!r}"
        return
    mapped.schedule = every * PERIOD_SECONDS[period]
    counted = "django-celery-beat counted each run from the previous one"
    phase_from = row.last_run_at or row.start_time
    if keep_phase and phase_from is not None:
        anchor = phase_from.replace(microsecond=0)
        what = "last run" if row.last_run_at else "start_time"
        mapped.anarchon["anchor"] = anchor
        mapped.notes.append(
            f"{counted}; here slots are the anchor plus whole intervals, anchored on its {what} "
            f"({iso(anchor)}), so its phase stays"
        )
    else:
        mapped.notes.append(
            f"{counted}; here slots are whole multiples of the interval from the Unix epoch "
            "(set anarchon={'anchor': ...} for another phase)"
        )
    if row.one_off:
        _one_off(mapped, row)


def _crontab(
    mapped: Mapped, row: PeriodicTaskRow, zone: ZoneInfo, keep_phase: bool, now_ms: int
) -> None:
    assert row.crontab is not None
    fields = {f: row.crontab.get(f) or "*" for f in CRONTAB_FIELDS}
    try:
        schedule = crontab(**fields)
    except (ValueError, TypeError) as exc:
        mapped.problem = f"crontab {fields} cannot be read: {exc}"
        return
    name = row.crontab.get("timezone")
    try:
        schedule.tz = ZoneInfo(str(name)) if name else zone
    except (ZoneInfoNotFoundError, ValueError):
        mapped.problem = f"crontab time zone {name!r} is not an IANA zone"
        return
    if not name:
        mapped.notes.append(
            f"DJANGO_CELERY_BEAT_TZ_AWARE is off: the crontab ran in the app's timezone, pinned "
            f"here as {zone.key}"
        )
    mapped.schedule = schedule
    if row.one_off:
        _one_off(mapped, row)


def _solar(
    mapped: Mapped, row: PeriodicTaskRow, zone: ZoneInfo, keep_phase: bool, now_ms: int
) -> None:
    assert row.solar is not None
    event, lat, lon = row.solar
    try:
        mapped.schedule = solar(event, lat, lon)
    except (ValueError, TypeError) as exc:
        mapped.problem = f"solar schedule {row.solar} cannot be read: {exc}"
        return
    if row.one_off:
        _one_off(mapped, row)


def _clocked(
    mapped: Mapped, row: PeriodicTaskRow, zone: ZoneInfo, keep_phase: bool, now_ms: int
) -> None:
    assert row.clocked is not None
    if row.clocked.timestamp() * 1000 <= now_ms:
        mapped.problem = (
            f"clocked time {iso(row.clocked)} has passed (django-celery-beat ran it then, or "
            "runs it at once when it starts): nothing left to run"
        )
        return
    mapped.schedule = row.clocked


def _one_off(mapped: Mapped, row: PeriodicTaskRow) -> None:
    mapped.anarchon["max_runs"] = 1
    if row.total_run_count > 0:
        mapped.paused, mapped.note = True, "imported from django-celery-beat: one_off, already ran"
        mapped.notes.append(
            "one_off and it already ran (django-celery-beat disables it at its next check): "
            "stored paused, with max_runs=1"
        )
    else:
        mapped.notes.append("one_off: max_runs=1, so the cluster sends it once, then it finishes")


def _bounds(mapped: Mapped, row: PeriodicTaskRow, now_ms: int) -> None:
    if row.start_time is not None:
        mapped.anarchon["start_at"] = row.start_time
    if row.expires is not None:
        if row.expires.timestamp() * 1000 <= now_ms:
            mapped.problem = (
                f"it expired at {iso(row.expires)} (django-celery-beat sends nothing after "
                "expires): nothing left to run"
            )
            return
        mapped.anarchon["end_at"] = row.expires - timedelta(milliseconds=1)
        mapped.notes.append(
            f"expires {iso(row.expires)}: end_at 1 ms before it (django-celery-beat sent "
            "nothing at or after expires; end_at is the last instant a slot may have); "
            "django-celery-beat also made each message expire then, here none does"
        )
    if not row.enabled:
        mapped.paused, mapped.note = True, DISABLED_NOTE
        mapped.notes.append("disabled in django-celery-beat: stored paused; resume it to run it")


def describe_source(row: PeriodicTaskRow) -> str:
    """The row's schedule as django-celery-beat's admin shows it, roughly."""
    if row.interval is not None:
        every, period = row.interval
        text = f"interval every {every} {period}"
    elif row.crontab is not None:
        c = row.crontab
        order = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        text = "crontab " + " ".join(str(c.get(f) or "*") for f in order)
        text += f" {c.get('timezone') or '(app zone)'}"
    elif row.solar is not None:
        event, lat, lon = row.solar
        text = f"solar {event} at {lat:g},{lon:g}"
    elif row.clocked is not None:
        text = f"clocked {iso(row.clocked)}"
    else:
        text = "no schedule"
    return text + (" one_off" if row.one_off else "")
