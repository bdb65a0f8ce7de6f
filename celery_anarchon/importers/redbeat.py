"""Import celery-redbeat's entries from its Redis as stored jobs.

celery-redbeat (``redbeat.RedBeatScheduler``, version 2) keeps, under its
``redbeat_key_prefix`` ``P`` (default ``redbeat:``):

* ``P:schedule``: a sorted set of entry keys, scored by the next run;
* ``P<name>``: one hash per entry, with the field ``definition`` (JSON:
  ``name``, ``task``, ``schedule``, ``args``, ``kwargs``, ``options``,
  ``enabled``) and the field ``meta`` (JSON: ``last_run_at``,
  ``total_run_count``);
* ``P:statics``: the names that came from the app's ``beat_schedule``.

Values are JSON with ``{"__type__": ...}`` objects for what JSON lacks
(``redbeat/decoder.py``): ``interval`` (``every`` seconds, ``relative``),
``crontab`` (the five fields, no zone), ``rrule``, ``datetime`` (fields and
a ``timezone``: an IANA name, ``"UTC"`` or an offset in seconds) and
``weekday``. This module reads that JSON itself, so redbeat need not be
installed.

Mapping (docs/migrating-redbeat.md):

==================  ===================================================
redbeat             stored job
==================  ===================================================
interval            seconds; anchored on the last run (``anchor``) so the
                    phase stays, or on the epoch when it never ran, with
                    ``relative``, or with ``keep_phase=False``
crontab             the same crontab, in the app's zone (redbeat keeps no
                    zone; it ran in the app's)
rrule               not mapped: no equivalent
enabled False       stored paused, note ``imported from redbeat: disabled``
a ``P:statics`` name  skipped: a ``beat_schedule`` entry, it stays code
==================  ===================================================
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import crontab

from ..backends import sanitize_url, scheme_of
from ..model import app_zone
from ..settings import first_broker_url
from ..stored import CRONTAB_FIELDS
from .common import ImportReport, ImportSourceError, Mapped, SourceUnavailable, iso, store

__all__ = ["DISABLED_NOTE", "RedbeatEntry", "import_redbeat", "map_entry", "read_entries"]

#: The pause note of an entry that was disabled in redbeat.
DISABLED_NOTE = "imported from redbeat: disabled"

#: redbeat's default ``redbeat_key_prefix``.
DEFAULT_PREFIX = "redbeat:"

#: dateutil's rrule frequencies, by their number.
RRULE_FREQS = ("YEARLY", "MONTHLY", "WEEKLY", "DAILY", "HOURLY", "MINUTELY", "SECONDLY")

#: How long a Redis call may take, seconds.
SOCKET_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedbeatEntry:
    """One entry as redbeat keeps it.

    Attributes:
        key: its hash's key (``P<name>``).
        definition: the ``definition`` field's JSON text, or None.
        meta: the ``meta`` field's JSON text, or None.
        static: its name is in ``P:statics`` (it came from ``beat_schedule``).
        error: why the key could not be read (not a hash), or None.
    """

    key: str
    definition: str | None
    meta: str | None
    static: bool = False
    error: str | None = None


def import_redbeat(
    app: Any,
    redis_url: str | None = None,
    *,
    key_prefix: str | None = None,
    dry_run: bool = False,
    keep_phase: bool = True,
    schedule_filename: str | None = None,
) -> ImportReport:
    """Store celery-redbeat's entries as stored jobs of ``app``.

    Args:
        app: the Celery app (its claim backend keeps the stored jobs; its
            ``redbeat_*`` settings and zone are read).
        redis_url: redbeat's Redis (``redis://`` or ``rediss://``); default
            ``redbeat_redis_url``, else the first ``broker_url``.
        key_prefix: redbeat's key prefix; default ``redbeat_key_prefix``,
            else ``redbeat:``.
        dry_run: write nothing; report what would be stored.
        keep_phase: anchor an interval on its last run, so it keeps the
            phase it had (False: on the Unix epoch).
        schedule_filename: beat's ``-s`` file, when the default SQLite
            backend is used with another file than the default.
    Returns:
        the report: one result per entry.
    Raises:
        ImportSourceError: the URL is not a Redis URL, or the schedule key
            is not redbeat's sorted set.
        SourceUnavailable: redbeat's Redis did not answer.
        StoredJobsRefused: the claim backend is claim-only (RabbitMQ).
        BackendUnavailable: the claim backend did not answer.
    """
    url = redis_url or app.conf.get("redbeat_redis_url") or first_broker_url(app.conf)
    prefix = key_prefix if key_prefix is not None else _conf_prefix(app)
    entries = read_entries(url, prefix)
    zone = app_zone(app)
    mapped = [map_entry(entry, prefix, zone, keep_phase=keep_phase) for entry in entries]
    where = f"{sanitize_url(url)} (key prefix {prefix!r})"
    return store(
        app,
        mapped,
        source="redbeat",
        read_from=where,
        dry_run=dry_run,
        schedule_filename=schedule_filename,
    )


def _conf_prefix(app: Any) -> str:
    value = app.conf.get("redbeat_key_prefix")
    return str(value) if value else DEFAULT_PREFIX


def read_entries(url: str, prefix: str) -> list[RedbeatEntry]:
    """Every entry of redbeat's schedule in the Redis at ``url``.

    Raises:
        ImportSourceError: ``url`` is not a ``redis://`` or ``rediss://``
            URL, or ``P:schedule`` is not a sorted set.
        SourceUnavailable: no answer.
    """
    import redis

    if scheme_of(url) not in {"redis", "rediss", "unix"}:
        raise ImportSourceError(
            f"redbeat keeps its entries in Redis, but {sanitize_url(url)!r} is not a Redis URL: "
            "pass --redis redis://HOST:PORT/DB (redbeat_redis_url of the old app)."
        )
    client = redis.Redis.from_url(
        url,
        decode_responses=True,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=SOCKET_TIMEOUT_S,
    )
    schedule_key, statics_key = f"{prefix}:schedule", f"{prefix}:statics"
    try:
        keys: list[str] = [str(k) for k in client.zrange(schedule_key, 0, -1)]
        statics = set(client.smembers(statics_key)) if client.type(statics_key) == "set" else set()
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(key, ["definition", "meta"])
            fields = pipe.execute(raise_on_error=False)
    except redis.ResponseError as exc:
        raise ImportSourceError(
            f"{schedule_key!r} at {sanitize_url(url)} is not redbeat's schedule ({exc}): "
            "is --key-prefix right (redbeat_key_prefix of the old app)?"
        ) from exc
    except redis.RedisError as exc:
        raise SourceUnavailable(
            f"redbeat's Redis at {sanitize_url(url)} did not answer: {exc}"
        ) from exc
    finally:
        client.close()
    entries = []
    for key, found in zip(keys, fields, strict=True):
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if isinstance(found, Exception):
            entries.append(RedbeatEntry(key, None, None, name in statics, str(found)))
        else:
            definition, meta = found
            entries.append(RedbeatEntry(key, definition, meta, name in statics))
    return entries


def map_entry(entry: RedbeatEntry, prefix: str, zone: ZoneInfo, *, keep_phase: bool) -> Mapped:
    """One redbeat entry as a stored job (or the reason it cannot be one).

    Args:
        entry: the entry as read.
        prefix: redbeat's key prefix (the name is the key without it).
        zone: the app's zone: a redbeat crontab ran in it.
        keep_phase: anchor an interval on its last run.
    """
    key_name = entry.key[len(prefix) :] if entry.key.startswith(prefix) else entry.key
    if entry.error is not None or entry.definition is None:
        why = entry.error or "it has no 'definition' field"
        return Mapped(key_name, "?", problem=f"key {entry.key!r} is not a redbeat entry: {why}")
    try:
        definition = decode(json.loads(entry.definition))
        meta = decode(json.loads(entry.meta)) if entry.meta else {}
    except (ValueError, TypeError, KeyError) as exc:
        return Mapped(key_name, "?", problem=f"unreadable redbeat JSON in {entry.key!r}: {exc}")
    if not isinstance(definition, dict):
        return Mapped(key_name, "?", problem=f"{entry.key!r}: the definition is not an object")
    name = str(definition.get("name") or key_name)
    raw_schedule = definition.get("schedule")
    mapped = Mapped(name, describe_source(raw_schedule))
    if entry.static:
        mapped.skip = (
            "a beat_schedule entry of the redbeat app (redbeat copies those into Redis): it "
            "stays a code entry; keep it in beat_schedule"
        )
        return mapped
    mapped.task = definition.get("task") or ""
    mapped.args = definition.get("args") or ()
    mapped.kwargs = definition.get("kwargs") or None
    mapped.options = definition.get("options") or None
    last_run = meta.get("last_run_at") if isinstance(meta, dict) else None
    _map_schedule(mapped, raw_schedule, last_run, zone, keep_phase)
    if definition.get("enabled", True) is False:
        mapped.paused, mapped.note = True, DISABLED_NOTE
        mapped.notes.append("disabled in redbeat: stored paused; resume it to run it")
    return mapped


def _map_schedule(
    mapped: Mapped, raw: Any, last_run: Any, zone: ZoneInfo, keep_phase: bool
) -> None:
    kind = raw.get("__type__") if isinstance(raw, dict) else None
    if kind == "interval":
        _map_interval(mapped, raw, last_run, keep_phase)
    elif kind == "crontab":
        fields = {f: raw.get(f, "*") for f in CRONTAB_FIELDS}
        try:
            schedule = crontab(**fields)
        except (ValueError, TypeError) as exc:
            mapped.problem = f"crontab {fields} cannot be read: {exc}"
            return
        schedule.tz = zone
        mapped.schedule = schedule
        mapped.notes.append(
            f"redbeat keeps no zone with a crontab: it ran in the app's timezone, pinned here "
            f"as {zone.key}"
        )
    elif kind == "rrule":
        mapped.problem = (
            "rrule schedules have no equivalent here: rewrite it as a crontab or cron string "
            "(or one-off datetimes) and add it with Schedules.add"
        )
    else:
        mapped.problem = f"unknown redbeat schedule {raw!r}"


def _map_interval(mapped: Mapped, raw: dict[str, Any], last_run: Any, keep_phase: bool) -> None:
    every = raw.get("every")
    if not isinstance(every, (int, float)) or isinstance(every, bool) or not math.isfinite(every):
        mapped.problem = f"interval {every!r} is not a number of seconds"
        return
    mapped.schedule = float(every)
    counted = "redbeat counted each run from the previous one"
    if raw.get("relative"):
        mapped.notes.append(
            "relative=True: redbeat put runs on the boundaries of the interval's unit in the "
            "app's zone; here slots are whole multiples of the interval from the Unix epoch (UTC)"
        )
    elif keep_phase and isinstance(last_run, datetime):
        anchor = last_run.replace(microsecond=0)
        mapped.anarchon["anchor"] = anchor
        mapped.notes.append(
            f"{counted}; here slots are the anchor plus whole intervals, anchored on its last "
            f"run ({iso(anchor)}), so its phase stays"
        )
    else:
        never = "" if last_run is not None else " (it never ran)"
        mapped.notes.append(
            f"{counted}{never}; here slots are whole multiples of the interval from the Unix "
            "epoch (set anarchon={'anchor': ...} for another phase)"
        )


def describe_source(raw: Any) -> str:
    """A redbeat schedule as the report shows it."""
    if not isinstance(raw, dict):
        return repr(raw)
    kind = raw.get("__type__")
    if kind == "interval":
        relative = " relative" if raw.get("relative") else ""
        return f"interval {raw.get('every')!r}s{relative}"
    if kind == "crontab":
        order = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        return "crontab " + " ".join(str(raw.get(f, "*")) for f in order)
    if kind == "rrule":
        freq = raw.get("freq")
        named = RRULE_FREQS[freq] if isinstance(freq, int) and 0 <= freq < 7 else freq
        shown = {}
        for key, value in raw.items():
            if key in ("__type__", "freq", "dtstart_tz", "until_tz") or value is None:
                continue
            if key in ("dtstart", "until") and isinstance(value, (int, float)):
                value = iso(datetime.fromtimestamp(value, timezone.utc))
            shown[key] = value
        return f"rrule {named} {shown}"
    return f"{kind or 'unknown'} {raw!r}"


def decode(value: Any) -> Any:
    """redbeat's JSON values with its ``datetime`` objects as aware
    datetimes; schedule objects (``interval``, ``crontab``, ``rrule``) and
    ``weekday`` stay dicts.

    Raises:
        ValueError, TypeError, KeyError: a malformed datetime object.
    """
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    decoded = {k: decode(v) for k, v in value.items()}
    if decoded.get("__type__") != "datetime":
        return decoded
    fields = {k: int(decoded[k]) for k in ("year", "month", "day")}
    for k in ("hour", "minute", "second", "microsecond"):
        fields[k] = int(decoded.get(k, 0))
    return datetime(**fields, tzinfo=_zone(decoded.get("timezone", "UTC")))


def _zone(value: Any) -> tzinfo:
    """redbeat's ``timezone`` of a datetime: an offset in seconds or a name."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timezone(timedelta(seconds=value))
    try:
        return ZoneInfo(str(value))
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r}") from None
