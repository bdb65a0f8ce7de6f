"""Stored jobs: the portable form of a job kept in the claim backend.

A stored job is a ``beat_schedule`` entry that lives in the backend instead
of the code: added, updated, paused, resumed and removed at runtime
(docs/runtime-schedules.md). This module is the one place that turns a
definition into the JSON text the backend keeps and back, and validates it
exactly as beat validates ``beat_schedule``:

* :func:`encode_schedule` and :func:`decode_schedule`: every schedule kind
  ``beat_schedule`` takes, as a small JSON object any host (any Python, any
  version of this package that knows the kind) reads the same way;
* :class:`Definition`: a stored job's definition, and its JSON body;
* :class:`StoredJob` and :class:`Pause`: what the backend answers, with the
  commit time every instance computes the same effective slot from.

JSON shapes of ``schedule`` (times are UTC; zones are IANA names):

====================================================  ==============================
``{"every": 30.0}``                                    seconds, a ``timedelta``
``{"cron": "*/5 * * * *", "tz": "Europe/Berlin"}``     a cron string, ``cron(...)``
``{"crontab": {"minute": "0", ...}, "tz": null}``      ``celery.schedules.crontab``
``{"solar": "sunrise", "lat": 52.5, "lon": 13.4}``     ``celery.schedules.solar``
``{"at": "2027-01-01T00:00:00.000Z"}``                 an aware datetime, ``oneoff``
====================================================  ==============================
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery import schedules as celery_schedules

from .exceptions import ConfigurationError
from .slots import cron, from_ms, oneoff, to_ms

__all__ = [
    "APPLY_DELAY_MS",
    "MAX_BODY_BYTES",
    "CRONTAB_FIELDS",
    "SEND_OPTIONS",
    "Definition",
    "Pause",
    "StoredJob",
    "StoredState",
    "decode_schedule",
    "encode_schedule",
    "stored_where",
]

#: A change takes effect from the first slot due at least this long after
#: its commit (the backend's clock), milliseconds: every instance applies it
#: within that second, so each computes the same slots from then on
#: (docs/runtime-schedules.md, "Slots across an update").
APPLY_DELAY_MS = 1000

#: The fields of a ``crontab``, in its order.
CRONTAB_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")

#: The ``apply_async`` options a stored job's ``options`` may hold: what
#: beat passes to Celery's ``apply_async`` for a ``beat_schedule`` entry
#: (https://docs.celeryq.dev/en/stable/reference/celery.app.task.html#celery.app.task.Task.apply_async).
SEND_OPTIONS = frozenset(
    {
        "queue",
        "exchange",
        "exchange_type",
        "routing_key",
        "priority",
        "expires",
        "serializer",
        "compression",
        "headers",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "retry",
        "retry_policy",
        "delivery_mode",
        "shadow",
        "mandatory",
        "countdown",
        "reply_to",
        "correlation_id",
        "content_type",
        "content_encoding",
    }
)

#: Largest body a stored job may have, bytes: below what every backend's
#: text column holds (MySQL's TEXT is 64 KiB). Big arguments belong in a
#: database the task reads, not in the schedule.
MAX_BODY_BYTES = 60_000


def stored_where(name: str) -> str:
    """How errors name a stored job (``beat_schedule`` texts, rewritten)."""
    return f"stored job {name!r}"


def _error(job: str, problem: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"{stored_where(job)}['schedule']: {problem}. Fix: {fix}.")


def _zone_key(zone: str | tzinfo | None, job: str) -> str | None:
    """An IANA zone name for ``zone`` (None stays None: the app's zone).

    Raises:
        ConfigurationError: a zone without an IANA name (a fixed offset),
            which another host could not read back the same way.
    """
    if zone is None:
        return None
    name: Any = zone
    if not isinstance(zone, str):
        name = getattr(zone, "key", None) or getattr(zone, "zone", None)
    if isinstance(name, str):
        try:
            ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            pass
        else:
            return name
    raise _error(job, f"time zone {zone!r} has no IANA name", "give a name such as 'Europe/Berlin'")


def _cron_field(value: Any) -> str:
    if isinstance(value, (set, frozenset, list, tuple, range)):
        return ",".join(str(v) for v in sorted(value))
    return str(value)


def encode_schedule(schedule: Any, *, job: str) -> dict[str, Any]:
    """The portable JSON object of a schedule ``beat_schedule`` takes.

    Args:
        schedule: seconds, a ``timedelta``, ``celery.schedules.schedule``, a
            cron string, :class:`~celery_anarchon.slots.cron`, a ``crontab``,
            a ``solar``, an aware ``datetime`` or
            :class:`~celery_anarchon.slots.oneoff`.
        job: the job's name, for errors.
    Returns:
        one of the shapes in the module docstring.
    Raises:
        ConfigurationError: anything else, a naive datetime, a zone without
            an IANA name, an interval that is not a finite number.
    """
    if isinstance(schedule, celery_schedules.schedule) and not isinstance(
        schedule, (celery_schedules.crontab, celery_schedules.solar)
    ):
        schedule = schedule.run_every
    if isinstance(schedule, timedelta):
        return {"every": schedule.total_seconds()}
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        if not math.isfinite(schedule):
            raise _error(job, f"interval {schedule!r} is not finite", "give a number of seconds")
        return {"every": float(schedule)}
    if isinstance(schedule, str):
        return {"cron": " ".join(schedule.split()), "tz": None}
    if isinstance(schedule, cron):
        return {"cron": schedule.expr, "tz": _zone_key(schedule.zone, job)}
    if isinstance(schedule, celery_schedules.crontab):
        fields = {f: _cron_field(getattr(schedule, f"_orig_{f}")) for f in CRONTAB_FIELDS}
        return {"crontab": fields, "tz": _zone_key(vars(schedule).get("tz"), job)}
    if isinstance(schedule, celery_schedules.solar):
        return {"solar": schedule.event, "lat": float(schedule.lat), "lon": float(schedule.lon)}
    at = schedule.at if isinstance(schedule, oneoff) else schedule
    if isinstance(at, datetime):
        if at.tzinfo is None or at.utcoffset() is None:
            raise _error(
                job,
                f"one-off datetime {at.isoformat()} is naive",
                "give it a time zone, e.g. 2027-01-01T00:00Z",
            )
        return {"at": _iso_ms(to_ms(at))}
    raise _error(
        job,
        f"unsupported schedule {schedule!r} ({type(schedule).__name__})",
        "give seconds, a timedelta, a cron string, cron(...), crontab(...), solar(...) "
        "or an aware datetime",
    )


def _iso_ms(ms: int) -> str:
    return from_ms(ms).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def decode_schedule(data: Mapping[str, Any], *, job: str) -> Any:
    """The schedule object of a portable JSON object (:func:`encode_schedule`).

    Raises:
        ConfigurationError: an object of no known shape (written by a newer
            version, or by hand), naming the job.
    """
    if not isinstance(data, Mapping):
        raise _error(job, f"{data!r} is not a stored schedule", "store it with Schedules.add")
    if "every" in data:
        return float(data["every"])
    if "cron" in data:
        return cron(str(data["cron"]), tz=data.get("tz"))
    if "crontab" in data:
        fields = data["crontab"]
        if not isinstance(fields, Mapping) or set(fields) - set(CRONTAB_FIELDS):
            raise _error(job, f"bad crontab fields {fields!r}", f"use {', '.join(CRONTAB_FIELDS)}")
        schedule = celery_schedules.crontab(**{k: str(v) for k, v in fields.items()})
        if data.get("tz"):
            schedule.__dict__["tz"] = ZoneInfo(str(data["tz"]))  # kombu's cached_property
        return schedule
    if "solar" in data:
        return celery_schedules.solar(str(data["solar"]), float(data["lat"]), float(data["lon"]))
    if "at" in data:
        text = str(data["at"]).replace("Z", "+00:00")
        try:
            at = datetime.fromisoformat(text)
        except ValueError:
            raise _error(job, f"bad instant {data['at']!r}", "give ISO 8601 with a zone") from None
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        return at
    raise _error(job, f"unknown stored schedule {dict(data)!r}", "upgrade celery-anarchon")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _portable_options(options: dict[str, Any]) -> dict[str, Any]:
    """Per-job options with their datetimes as JSON holds them: ``start_at``
    and ``end_at`` as ISO 8601 texts in UTC, ``anchor`` as epoch seconds (a
    naive datetime is left for the settings' check to refuse, naming it)."""
    for key in ("start_at", "end_at", "anchor"):
        value = options.get(key)
        if isinstance(value, datetime) and value.utcoffset() is not None:
            ms = to_ms(value)
            options[key] = ms / 1000 if key == "anchor" else _iso_ms(ms)
    return options


def _json_value(value: Any, where: str, fix: str) -> Any:
    """``value`` as JSON reads it back (tuples become lists).

    Raises:
        ConfigurationError: it cannot be JSON-encoded.
    """
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        problem = f"{where}: {value!r} cannot be stored as JSON ({exc}). {fix}"
        raise ConfigurationError(problem) from None


@dataclass(frozen=True)
class Definition:
    """A stored job's definition: what ``beat_schedule`` would hold for it.

    Attributes:
        name: the job's name (any non-empty string a ``beat_schedule`` key may be).
        task: the task's registered name.
        schedule: the portable schedule (:func:`encode_schedule`).
        args: positional arguments (JSON values).
        kwargs: keyword arguments (JSON values).
        options: ``apply_async`` options (:data:`SEND_OPTIONS`).
        anarchon: per-job options, as under ``beat_schedule[name]['anarchon']``.
    """

    name: str
    task: str
    schedule: dict[str, Any]
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    anarchon: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        name: Any,
        task: Any,
        schedule: Any,
        args: Any = (),
        kwargs: Any = None,
        options: Any = None,
        anarchon: Any = None,
    ) -> Definition:
        """A definition from what ``beat_schedule`` takes, its shapes checked.

        Raises:
            ConfigurationError: an empty or non-string name or task, a
                schedule :func:`encode_schedule` refuses, args that are not a
                list, kwargs or options that are not a dict, an unknown
                option, or a value that cannot be stored as JSON.
        """
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"stored job name {name!r}: give a non-empty string, e.g. 'nightly-report'."
            )
        if "\x00" in name or not _encodable(name):
            raise ConfigurationError(
                f"stored job name {name!r}: holds a NUL or a lone surrogate, which the "
                "backends cannot store; give a name of printable text."
            )
        where = stored_where(name)
        if not isinstance(task, str) or not task:
            raise ConfigurationError(
                f"{where}['task']: {task!r} is not a task name; give the registered name, "
                "e.g. 'proj.tasks.report'."
            )
        if not isinstance(args, (list, tuple)):
            raise ConfigurationError(f"{where}['args']: expected a list, got {args!r}.")
        for key, value in (("kwargs", kwargs), ("options", options), ("anarchon", anarchon)):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigurationError(f"{where}[{key!r}]: expected a dict, got {value!r}.")
        unknown = sorted(set(options or {}) - SEND_OPTIONS)
        if unknown:
            raise ConfigurationError(
                f"{where}['options']: unknown option(s) {', '.join(unknown)}. Allowed: "
                f"{', '.join(sorted(SEND_OPTIONS))}."
            )
        anarchon = _portable_options(dict(anarchon or {}))
        json_fix = "Fix: give strings, numbers, booleans, None, lists and dicts only."
        definition = cls(
            name=name,
            task=task,
            schedule=encode_schedule(schedule, job=name),
            args=_json_value(list(args), f"{where}['args']", json_fix),
            kwargs=_json_value(dict(kwargs or {}), f"{where}['kwargs']", json_fix),
            options=_json_value(dict(options or {}), f"{where}['options']", json_fix),
            anarchon=_json_value(dict(anarchon or {}), f"{where}['anarchon']", json_fix),
        )
        size = len(definition.body().encode("utf-8", "surrogatepass"))
        if size > MAX_BODY_BYTES:
            raise ConfigurationError(
                f"{where}: the definition is {size:,} bytes, over {MAX_BODY_BYTES:,}. Fix: pass "
                "a key the task looks its data up by, not the data itself."
            )
        return definition

    def fields(self) -> dict[str, Any]:
        """The definition without its name, as JSON holds it (the body's
        object; what the commands print)."""
        return {
            "task": self.task,
            "schedule": self.schedule,
            "args": self.args,
            "kwargs": self.kwargs,
            "options": self.options,
            "anarchon": self.anarchon,
        }

    def body(self) -> str:
        """The JSON text the backend keeps (keys sorted: one text per definition)."""
        return json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_body(cls, name: str, body: str) -> Definition:
        """The definition a backend kept (:meth:`body`).

        Raises:
            ConfigurationError: a body that is not a definition's JSON.
        """
        try:
            fields = json.loads(body)
            return cls(
                name=name,
                task=str(fields["task"]),
                schedule=dict(fields["schedule"]),
                args=list(fields.get("args") or []),
                kwargs=dict(fields.get("kwargs") or {}),
                options=dict(fields.get("options") or {}),
                anarchon=dict(fields.get("anarchon") or {}),
            )
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"{stored_where(name)}: unreadable stored body ({exc!r})."
            raise ConfigurationError(problem) from None

    def entry_fields(self) -> dict[str, Any]:
        """The ``beat_schedule`` entry this definition stands for."""
        fields: dict[str, Any] = {
            "task": self.task,
            "schedule": decode_schedule(self.schedule, job=self.name),
            "args": tuple(self.args),
            "kwargs": dict(self.kwargs),
            "options": dict(self.options),
        }
        if self.anarchon:
            fields["anarchon"] = dict(self.anarchon)
        return fields

    def describe_schedule(self) -> str:
        """The schedule as a short text: ``every 30s``, ``cron '*/5 * * * *' Europe/Berlin``."""
        s = self.schedule
        if "every" in s:
            return f"every {s['every']:g}s"
        if "cron" in s:
            return f"cron {s['cron']!r}" + (f" {s['tz']}" if s.get("tz") else "")
        if "crontab" in s:
            f = s["crontab"]
            order = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
            text = " ".join(str(f[k]) for k in order)
            return f"crontab {text!r}" + (f" {s['tz']}" if s.get("tz") else "")
        if "solar" in s:
            return f"solar {s['solar']} at {s['lat']:g},{s['lon']:g}"
        return f"once at {s.get('at')}"


@dataclass(frozen=True)
class StoredJob:
    """A stored job as the backend answers it.

    Attributes:
        definition: its definition.
        version: the change counter's value when it was written.
        committed_ms: when it was written, epoch ms (the backend's clock).
    """

    definition: Definition
    version: int
    committed_ms: int

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def effective_ms(self) -> int:
        """Its first slot is the first at or after this, epoch ms
        (:data:`APPLY_DELAY_MS` after the commit)."""
        return self.committed_ms + APPLY_DELAY_MS


@dataclass(frozen=True)
class Pause:
    """The pause state of one job (code or stored), as the backend keeps it.

    Attributes:
        name: the job's name.
        paused: True while paused.
        note: the operator's note, or "".
        paused_ms: when the pause was committed, epoch ms (backend clock).
        resumed_ms: when the resume was committed, epoch ms, or None.
        version: the change counter's value when it was written.
    """

    name: str
    paused: bool
    note: str = ""
    paused_ms: int = 0
    resumed_ms: int | None = None
    version: int = 0

    @property
    def from_ms(self) -> int:
        """Slots at or after this are paused, epoch ms."""
        return self.paused_ms + APPLY_DELAY_MS

    @property
    def until_ms(self) -> int | None:
        """Slots at or after this run again (None while paused), epoch ms."""
        return None if self.resumed_ms is None else self.resumed_ms + APPLY_DELAY_MS

    def covers(self, slot_ms: int) -> bool:
        """Whether the slot at ``slot_ms`` falls in this pause."""
        until = self.until_ms
        return slot_ms >= self.from_ms and (until is None or slot_ms < until)

    def body(self) -> str:
        """The JSON text the backend keeps: the commit time of the write is
        the backend's (``paused_ms`` of a pause, ``resumed_ms`` of a
        resume), so a resume carries the pause's time along."""
        fields: dict[str, Any] = {"paused": self.paused, "note": self.note}
        if not self.paused:
            fields["paused_ms"] = self.paused_ms
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_record(cls, name: str, body: str, version: int, committed_ms: int) -> Pause:
        """The pause state a backend kept (:meth:`body`), committed at
        ``committed_ms`` (epoch ms, the backend's clock)."""
        fields = json.loads(body)
        if fields.get("paused"):
            return cls(name, True, str(fields.get("note") or ""), committed_ms, None, version)
        paused_ms = int(fields.get("paused_ms") or 0)
        return cls(name, False, str(fields.get("note") or ""), paused_ms, committed_ms, version)


@dataclass
class StoredState:
    """The stored jobs and pause states as of one version, kept up to date
    from the backend's records (:meth:`apply`).

    Attributes:
        version: the newest version applied (0: none).
        jobs: the stored jobs, by name.
        pauses: the pause states, by job name (code or stored job).
        unreadable: ``{name: error}`` of stored jobs whose body could not
            be read (logged by the reader, never applied).
        committed_ms: when the newest version applied was committed, epoch
            ms (the backend's clock), 0 before any.
    """

    version: int = 0
    jobs: dict[str, StoredJob] = field(default_factory=dict)
    pauses: dict[str, Pause] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    committed_ms: int = 0

    def apply(self, records: Any) -> list[tuple[str, str]]:
        """Fold ``records`` (``StoredRecord`` objects, oldest first) in.

        Returns:
            ``(kind, name)`` of each record applied, in order.
        """
        changed = []
        for record in records:
            if record.version <= self.version and self.version:
                continue
            if record.version > self.version:
                self.version, self.committed_ms = record.version, record.committed_ms
            name = record.name
            changed.append((record.kind, name))
            if record.kind == "job":
                self.unreadable.pop(name, None)
                if record.body is None:
                    self.jobs.pop(name, None)
                    continue
                try:
                    definition = Definition.from_body(name, record.body)
                except ConfigurationError as exc:
                    self.jobs.pop(name, None)
                    self.unreadable[name] = str(exc)
                    continue
                self.jobs[name] = StoredJob(definition, record.version, record.committed_ms)
            elif record.kind == "pause":
                if record.body is None:
                    self.pauses.pop(name, None)
                else:
                    self.pauses[name] = Pause.from_record(
                        name, record.body, record.version, record.committed_ms
                    )
        return changed
