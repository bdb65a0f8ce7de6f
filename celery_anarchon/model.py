"""The schedule as the scheduler runs it: entries, jobs and their windows.

:class:`Entry` is Celery's ``ScheduleEntry`` with the ``'anarchon'`` key and
the schedules Celery lacks (cron strings, one-off datetimes); :class:`Job`
is one entry with its slot arithmetic and effective options, and answers
the windows of one slot (its deadline, its claim request).
:func:`build_jobs` validates a whole ``beat_schedule``. Beat, the control
API and the CLI all read the schedule through this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat
from celery import schedules as celery_schedules

from .backends.base import ClaimRequest
from .exceptions import ConfigurationError
from .message import expires_for
from .settings import JobOptions, Settings
from .slots import BoundedSlots, Slots, cron, oneoff, slots_for
from .stored import Pause, StoredJob, stored_where
from .times import ms as _ms

__all__ = [
    "KEEP_MARGIN_MS",
    "MIN_INTERVAL",
    "Entry",
    "Job",
    "app_zone",
    "build_jobs",
    "job_from_stored",
    "jobs_from_stored",
    "missing_key",
]

#: Extra time a claim record is kept after the last instant a late instance
#: could still try it, milliseconds.
KEEP_MARGIN_MS = 60_000

#: The shortest interval a job may have, seconds (docs/configuration.md):
#: beat's tick resolution. Each slot is a claim round trip and a publish on
#: every instance, and a tick of a busy beat takes milliseconds to tens of
#: milliseconds; a shorter interval outruns the tick, and slots are missed
#: in bulk instead of sent.
MIN_INTERVAL = 0.1


def missing_key(name: str | None, key: str) -> str:
    """The error of an entry without ``key`` (``'task'`` or ``'schedule'``):
    one text for ``celery anarchon check`` and beat's start-up."""
    return f"beat_schedule[{name!r}]: no {key!r}; every entry needs a task and a schedule."


def shape_problem(name: str | None, args: Any, kwargs: Any) -> str | None:
    """Why an entry's ``args`` (a list or tuple) or ``kwargs`` (a dict) have
    the wrong shape, or None: one text for ``check`` and beat's start-up."""
    if args is not None and not isinstance(args, (list, tuple)):
        return (
            f"beat_schedule[{name!r}]['args']: expected a list or tuple, got {args!r}; "
            f"e.g. 'args': [{args!r}]."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        return (
            f"beat_schedule[{name!r}]['kwargs']: expected a dict, got {kwargs!r}; "
            "e.g. 'kwargs': {'name': value}."
        )
    return None


def _check_interval(name: str | None, schedule: Any) -> None:
    """Refuse an interval schedule (seconds, a timedelta, Celery's
    ``schedule``) that is not finite or is below :data:`MIN_INTERVAL`.

    Raises:
        ConfigurationError: naming the job, the setting and the fix.
    """
    if isinstance(schedule, celery_schedules.schedule) and not isinstance(
        schedule, (celery_schedules.crontab, celery_schedules.solar)
    ):
        schedule = schedule.run_every
    if isinstance(schedule, timedelta):
        seconds = schedule.total_seconds()
    elif isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        seconds = float(schedule)
    else:
        return
    where = f"beat_schedule[{name!r}]['schedule']"
    if not math.isfinite(seconds):
        raise ConfigurationError(
            f"{where}: interval {seconds!r} s is not a finite number. Fix: give a number of "
            f"seconds of at least {MIN_INTERVAL:g}, a timedelta, or a cron schedule."
        )
    if seconds < MIN_INTERVAL:
        raise ConfigurationError(
            f"{where}: interval {seconds:g} s is below the floor of {MIN_INTERVAL:g} s (beat's "
            "tick resolution: each slot is a claim and a publish, and shorter intervals "
            f"outrun the tick). Fix: give an interval of at least {MIN_INTERVAL:g} s."
        )


class Entry(beat.ScheduleEntry):
    """A ``beat_schedule`` entry that also takes an ``'anarchon'`` key (per-job
    options) and schedules Celery itself does not: cron strings and one-off
    datetimes.

    Celery's own scheduler rejects the ``'anarchon'`` key: remove it when
    switching back.
    """

    def __init__(
        self,
        name: str | None = None,
        task: str | None = None,
        last_run_at: datetime | None = None,
        total_run_count: int | None = None,
        schedule: Any = None,
        args: Any = (),
        kwargs: Any = None,
        options: Any = None,
        relative: bool = False,
        app: Any = None,
        anarchon: Mapping[str, Any] | None = None,
    ) -> None:
        _check_interval(name, schedule)
        if isinstance(schedule, str):
            schedule = cron(schedule)
        elif isinstance(schedule, datetime):
            schedule = oneoff(schedule)
        elif not isinstance(schedule, (int, float, timedelta)) and not hasattr(schedule, "is_due"):
            raise ConfigurationError(
                f"beat_schedule[{name!r}]['schedule']: {schedule!r} is not a schedule. Fix: "
                "give seconds, a timedelta, a crontab/solar/cron object, a cron string "
                "or an aware datetime."
            )
        self.anarchon = dict(anarchon or {})
        super().__init__(
            name=name,
            task=task,
            last_run_at=last_run_at,
            total_run_count=total_run_count,
            schedule=schedule,
            args=args,
            kwargs=kwargs,
            options=options,
            relative=relative,
            app=app,
        )

    def update(self, other: beat.ScheduleEntry) -> None:
        super().update(other)
        self.anarchon = dict(getattr(other, "anarchon", {}))

    def editable_fields_equal(self, other: beat.ScheduleEntry) -> bool:
        return super().editable_fields_equal(other) and self.anarchon == getattr(
            other, "anarchon", {}
        )

    def __reduce__(self) -> Any:
        cls, args = super().__reduce__()
        return _rebuild_entry, (cls, args, self.anarchon)


def _rebuild_entry(cls: type[Entry], args: tuple[Any, ...], anarchon: dict[str, Any]) -> Entry:
    entry = cls(*args)
    entry.anarchon = anarchon
    return entry


@dataclass
class Job:
    """One scheduled job as the scheduler runs it.

    Attributes:
        name: the ``beat_schedule`` key.
        entry: the Celery entry (task, args, options).
        slots: the job's slot arithmetic.
        options: its effective options.
        definition: a stable text of its definition (same on every host that
            runs the same schedule), for drift detection.
        next_slot_ms: the next slot to act on, epoch ms, or None when done.
        source: ``"code"`` (``beat_schedule``) or ``"stored"`` (in the
            backend, docs/runtime-schedules.md).
        version: a stored job's version (the change counter), else 0.
        pause: its pause state, when it was ever paused (code or stored).
        retired_ms: set once an update or a removal replaced this job, or
            it finished: its slots at or after this (epoch ms) are no longer
            claimed.
        finished: why the job is finished (``"max_runs=3 reached"``,
            ``"end_at ... passed"``), or "".
    """

    name: str
    entry: Entry
    slots: Slots
    options: JobOptions
    definition: str
    next_slot_ms: int | None = None
    source: str = "code"
    version: int = 0
    pause: Pause | None = None
    retired_ms: int | None = None
    finished: str = ""

    def paused_at(self, slot_ms: int) -> bool:
        """Whether the slot at ``slot_ms`` falls in the job's pause."""
        return self.pause is not None and self.pause.covers(slot_ms)

    def retired_at(self, slot_ms: int) -> bool:
        """Whether the slot at ``slot_ms`` belongs to a definition that
        was replaced or removed before it."""
        return self.retired_ms is not None and slot_ms >= self.retired_ms

    def deadline_ms(self, slot_ms: int) -> int:
        """The last instant ``slot_ms`` may still be sent: ``slot + max_late``,
        epoch ms. Later, the slot is missed (or, claimed, recorded lost)."""
        return slot_ms + _ms(self.options.max_late)

    def claim_request(self, slot_ms: int, max_skew: float) -> ClaimRequest:
        """The claim request for ``slot_ms`` with this job's windows."""
        o = self.options
        jitter_ms, late_ms, skew_ms = _ms(o.jitter), _ms(o.max_late), _ms(max_skew)
        return ClaimRequest(
            job=self.name,
            slot_ms=slot_ms,
            window_before_ms=late_ms + jitter_ms,
            window_after_ms=skew_ms,
            keep_until_ms=slot_ms + jitter_ms + late_ms + skew_ms + KEEP_MARGIN_MS,
            lease_ms=_ms(o.lease_ttl),
            history_size=o.history_size,
            history_ttl_ms=_ms(o.history_ttl),
            max_runs=o.max_runs,
        )

    def catch_up_request(self, slot_ms: int, now_ms: int, max_skew: float) -> ClaimRequest:
        """The claim request for a slot claimed late on purpose (catch-up, or
        a take-over past ``max_late`` to record it lost): its window reaches
        back from ``now_ms`` to ``slot_ms``."""
        request = self.claim_request(slot_ms, max_skew)
        back_ms = now_ms - slot_ms + request.window_before_ms
        keep_ms = now_ms + request.keep_until_ms - slot_ms
        return dataclasses.replace(request, window_before_ms=back_ms, keep_until_ms=keep_ms)

    def window_end_ms(self, slot_ms: int, max_skew: float) -> int:
        """The last instant any instance may still claim ``slot_ms``
        (``max_late + jitter + max_skew`` after it), epoch ms."""
        o = self.options
        return slot_ms + _ms(o.max_late + o.jitter + max_skew)

    def expires(self, slot_ms: int) -> datetime | None:
        """When the message of the run at ``slot_ms`` expires
        (``anarchon_expires``, see :func:`~celery_anarchon.message.expires_for`),
        or None."""
        if self.options.expires is None:
            return None
        following = self.slots.next_after(slot_ms) if self.options.expires == "next_slot" else None
        return expires_for(self.options, slot_ms, following)

    def keep_until_ms(self, slot_ms: int, max_skew: float) -> int:
        """Until when a record of ``slot_ms`` must be kept, epoch ms."""
        return self.claim_request(slot_ms, max_skew).keep_until_ms


def app_zone(app: Any) -> ZoneInfo:
    """The app's ``timezone`` as a ZoneInfo (UTC when unset)."""
    name = app.conf.timezone or "UTC"
    try:
        return ZoneInfo(str(name))
    except Exception as exc:
        raise ConfigurationError(
            f"timezone: unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin'."
        ) from exc


def build_jobs(
    entries: Mapping[str, beat.ScheduleEntry], settings: Settings, zone: ZoneInfo
) -> dict[str, Job]:
    """Validate every entry and build its :class:`Job`.

    Raises:
        ConfigurationError: an entry without a task, a bad schedule or
            per-job option, naming the job.
    """
    jobs = {}
    shared: dict[Any, Slots] = {}  # one Slots per distinct definition
    for name, entry in entries.items():
        if not entry.task:
            raise ConfigurationError(missing_key(name, "task"))
        shape = shape_problem(name, entry.args, entry.kwargs)
        if shape is not None:
            raise ConfigurationError(shape)
        overrides = getattr(entry, "anarchon", None)
        options = settings.job_options(name, overrides)
        slots = slots_for(
            entry.schedule, job=name, tz=zone, anchor_ms=options.anchor_ms, shared=shared
        )
        if options.start_at_ms is not None or options.end_at_ms is not None:
            slots = BoundedSlots(slots, options.start_at_ms, options.end_at_ms)
        text = "\x00".join(
            [
                slots.describe(),  # what definition() gives, without building again
                str(entry.task),
                repr(entry.args),
                repr(sorted((entry.kwargs or {}).items())),
            ]
        )
        jobs[name] = Job(name, entry, slots, options, hashlib.sha1(text.encode()).hexdigest()[:12])
    return jobs


def job_from_stored(stored: StoredJob, app: Any, settings: Settings, zone: ZoneInfo) -> Job:
    """The :class:`Job` of a stored job, validated as a ``beat_schedule``
    entry is; its slots start at the stored job's effective time
    (:attr:`StoredJob.effective_ms`), the same on every instance.

    Raises:
        ConfigurationError: as :func:`build_jobs`, naming the stored job.
    """
    jobs, errors = jobs_from_stored([stored], app, settings, zone)
    if errors:
        raise ConfigurationError(errors[stored.name])
    return jobs[stored.name]


def jobs_from_stored(
    stored: Iterable[StoredJob], app: Any, settings: Settings, zone: ZoneInfo
) -> tuple[dict[str, Job], dict[str, str]]:
    """:func:`job_from_stored` for many stored jobs at once (one
    :func:`build_jobs` pass: cron parsers shared, as for ``beat_schedule``).

    Returns:
        ``(jobs, errors)``: the jobs by name, and ``{name: message}`` of
        those that could not be built.
    """
    by_name = {s.name: s for s in stored}
    entries, errors = {}, {}
    now = app.now()  # Celery's bookkeeping only (see Scheduler.merge_inplace), read once
    for name, one in by_name.items():
        fields = dict(one.definition.entry_fields(), name=name, app=app, last_run_at=now)
        try:
            entries[name] = Entry(**fields)
        except ConfigurationError as exc:
            errors[name] = _stored_text(str(exc), name)
    try:
        jobs = build_jobs(entries, settings, zone)
    except ConfigurationError:  # one of them is bad: find which, keep the rest
        jobs = {}
        for name, entry in entries.items():
            try:
                jobs.update(build_jobs({name: entry}, settings, zone))
            except ConfigurationError as exc:
                errors[name] = _stored_text(str(exc), name)
    for name, job in jobs.items():
        one = by_name[name]
        job.slots = BoundedSlots(job.slots, one.effective_ms)
        job.source = "stored"
        job.version = one.version
    return jobs, errors


def _stored_text(message: str, name: str) -> str:
    return message.replace(f"beat_schedule[{name!r}]", stored_where(name))
