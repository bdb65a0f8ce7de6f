"""Slot arithmetic: when each job fires, the same on every host.

A *slot* is one job at one scheduled fire time, identified by the job name and
the fire time in integer milliseconds since the Unix epoch (UTC). Every
scheduler instance computes slots from the schedule alone, never from its own
``last_run_at`` or start time, so every host and every restart agree (see
docs/how-it-works.md, "Slots"). This module is pure time arithmetic: no I/O,
and it never reads a clock.

Schedule kinds and their slots:

* ``celery.schedules.crontab``: every match of the fields in the schedule's
  zone, with Celery's meaning: day-of-month AND day-of-week must both match.
* a cron string or :class:`cron`: croniter's reading of crontab(5), POSIX
  meaning: when both day fields are restricted, either may match (OR). Six
  fields put the seconds LAST (``'* * * * * */2'``: every 2 s), as croniter
  reads them; ``L``, ``W``, ``#``, ``@daily`` and the rest as croniter supports;
  ``H`` is hashed from the job name, so it is the same on every host.
* a ``timedelta``, a number of seconds or ``celery.schedules.schedule``:
  ``anchor + k * interval`` for every integer ``k``, anchor the Unix epoch
  unless given, in whole milliseconds.
* ``celery.schedules.solar``: the sun event times, each the first after the
  previous slot.
* an aware ``datetime`` or :class:`oneoff`: that instant, once.

Cron matches are computed on local wall time in the schedule's zone and then
mapped to instants by this module, with one DST rule on every host (the
classic cron rule, see cron(8) of Vixie cron):

* a wall time that does not exist (spring forward) fires once, at the end of
  the gap (the first real instant after it);
* in a repeated hour (fall back), a job whose hour field is ``*`` (all 24
  hours) follows real elapsed time through both occurrences; a job whose hour
  field names hours fires at the first occurrence only;
* wall times that map to one instant are one slot.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery import schedules
from croniter import CroniterBadDateError, CroniterError, croniter

from .exceptions import ConfigurationError
from .times import iso

__all__ = [
    "Slots",
    "IntervalSlots",
    "CronSlots",
    "SolarSlots",
    "OneoffSlots",
    "BoundedSlots",
    "cron",
    "oneoff",
    "slots_for",
    "first_slot",
    "definition",
    "to_ms",
    "from_ms",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_NAIVE_EPOCH = datetime(1970, 1, 1)
_MS = timedelta(milliseconds=1)
_SECOND = timedelta(seconds=1)

#: How far croniter searches for the next match, in years. croniter's own
#: default (50) cannot reach a year field past 2020 from the epoch anchor.
_MAX_YEARS = 130

#: croniter's ``R`` (random) field: different on every host, so refused.
_RANDOM_FIELD = re.compile(r"^r(\(\d+-\d+\))?(/\d+)?$", re.IGNORECASE)

#: What Celery's own machinery is told about a schedule with no more slots:
#: check again in ten years.
_NEVER = timedelta(days=3650)


def to_ms(dt: datetime) -> int:
    """An aware datetime as integer epoch milliseconds (UTC).

    Sub-millisecond parts are dropped (floor).

    Raises:
        ValueError: ``dt`` is naive.
    """
    if dt.tzinfo is None or dt.utcoffset() is None:
        raise ValueError(f"naive datetime {dt!r}: give it a tzinfo")
    return (dt - _EPOCH) // _MS


def from_ms(ms: int) -> datetime:
    """Integer epoch milliseconds as an aware datetime in UTC."""
    return _EPOCH + timedelta(milliseconds=ms)


def _seconds_text(ms: int) -> str:
    """``60s``, ``0.5s``: a millisecond duration in seconds, exactly."""
    whole, part = divmod(ms, 1000)
    return f"{whole}s" if not part else f"{whole}.{part:03d}".rstrip("0") + "s"


def _zone_name(zone: tzinfo) -> str:
    return str(getattr(zone, "key", None) or getattr(zone, "zone", None) or zone)


@functools.lru_cache(maxsize=1024)
def _interval_text(interval_ms: int, anchor_ms: int) -> str:
    """:meth:`IntervalSlots.describe`, once per distinct interval and anchor
    (100,000 jobs share a few)."""
    return f"every {_seconds_text(interval_ms)} from {iso(anchor_ms, exact=True)}"


class Slots(Protocol):
    """The slots of one job: what the scheduler asks of every schedule kind."""

    def next_after(self, after_ms: int) -> int | None:
        """The first slot strictly after ``after_ms``.

        Args:
            after_ms: an instant, epoch milliseconds (UTC).

        Returns:
            The slot, epoch milliseconds (UTC), or None when the schedule has
            no slot after ``after_ms``.
        """
        ...

    def describe(self) -> str:
        """A stable, human-readable text of the schedule, the same on every host."""
        ...


class IntervalSlots:
    """Slots every ``interval_ms``, phased on ``anchor_ms``: ``anchor + k * interval``.

    Pure integer arithmetic on epoch milliseconds (UTC); time zones do not
    matter. With the default anchor (the Unix epoch, a Thursday 00:00 UTC) a
    weekly interval fires on Thursdays 00:00 UTC.

    Args:
        interval_ms: the interval, milliseconds, above zero.
        anchor_ms: one slot of the series, epoch milliseconds (UTC).
    """

    def __init__(self, interval_ms: int, anchor_ms: int = 0) -> None:
        if interval_ms <= 0:
            raise ValueError(f"interval must be above zero, got {interval_ms} ms")
        self.interval_ms = interval_ms
        self.anchor_ms = anchor_ms

    def next_after(self, after_ms: int) -> int:
        """The first ``anchor + k * interval`` strictly after ``after_ms`` (epoch ms UTC)."""
        k = (after_ms - self.anchor_ms) // self.interval_ms + 1
        return self.anchor_ms + k * self.interval_ms

    def describe(self) -> str:
        """``every 60s from 1970-01-01T00:00:00Z``."""
        return _interval_text(self.interval_ms, self.anchor_ms)


class OneoffSlots:
    """One slot at ``at_ms`` (epoch milliseconds, UTC), then none."""

    def __init__(self, at_ms: int) -> None:
        self.at_ms = at_ms

    def next_after(self, after_ms: int) -> int | None:
        """``at_ms`` while it is after ``after_ms`` (epoch ms UTC), else None."""
        return self.at_ms if self.at_ms > after_ms else None

    def describe(self) -> str:
        """``once at 2026-06-01T12:00:00Z``."""
        return f"once at {iso(self.at_ms, exact=True)}"


class BoundedSlots:
    """Another schedule's slots between two instants: a job's ``start_at``
    and ``end_at``, or a stored job's definition from the instant it takes
    effect (docs/runtime-schedules.md, "When a change holds").

    Args:
        inner: the schedule's slots.
        start_ms: the first instant a slot may have, epoch milliseconds
            (UTC), or None.
        end_ms: the last instant a slot may have, epoch milliseconds (UTC),
            or None.
    """

    def __init__(self, inner: Slots, start_ms: int | None, end_ms: int | None = None) -> None:
        self.inner = inner
        self.start_ms = start_ms
        self.end_ms = end_ms

    def next_after(self, after_ms: int) -> int | None:
        """The inner schedule's first slot after ``after_ms`` and inside the
        bounds (epoch ms UTC), or None."""
        if self.start_ms is not None:
            after_ms = max(after_ms, self.start_ms - 1)
        slot = self.inner.next_after(after_ms)
        if slot is not None and self.end_ms is not None and slot > self.end_ms:
            return None
        return slot

    def describe(self) -> str:
        """``every 60s from 1970-01-01T00:00:00Z, slots from 2027-01-01T00:00:01Z``."""
        text = self.inner.describe()
        if self.start_ms is not None:
            text += f", slots from {iso(self.start_ms, exact=True)}"
        if self.end_ms is not None:
            text += f", until {iso(self.end_ms, exact=True)}"
        return text


class CronSlots:
    """Slots of a cron expression read on the wall clock of ``zone``.

    croniter finds the matching local wall times (naive, so croniter applies
    no DST logic of its own); this class maps each to instants with the DST
    rule of the module docstring. The gap rule holds for every job, so on a
    spring-forward day ``'30 * * * *'`` in Europe/Berlin also fires at 03:00
    CEST for the missing 02:30 (Vixie cron would skip it); only the repeated
    hour depends on the hour field. Slots are whole seconds. One croniter
    object is made per instance and reused under a lock, so a call costs one
    or two croniter steps plus a few offset look-ups.

    Args:
        expr: the expression as croniter reads it: 5 fields, 6 with seconds
            last, 7 with a year last, or an ``@`` alias.
        zone: the zone whose wall clock the fields describe.
        day_or: True for POSIX cron (day-of-month OR day-of-week when both
            are restricted), False for Celery's crontab (AND).
        hash_id: croniter's seed for ``H`` fields (the job name), or None.
        kind: ``cron`` or ``crontab``, for :meth:`describe`.

    Raises:
        croniter.CroniterError: croniter cannot read ``expr``.
    """

    def __init__(
        self,
        expr: str,
        zone: tzinfo,
        *,
        day_or: bool = True,
        hash_id: str | None = None,
        kind: str = "cron",
    ) -> None:
        self.expr = expr
        self.zone = zone
        self.day_or = day_or
        self.kind = kind
        self._iter = croniter(
            expr,
            datetime(2000, 1, 1),
            ret_type=datetime,
            day_or=day_or,
            hash_id=hash_id,
            max_years_between_matches=_MAX_YEARS,
        )
        #: croniter's expanded fields (minute, hour, day-of-month, month,
        #: day-of-week, then seconds and year when given).
        self.expanded: list[list[Any]] = self._iter.expanded
        #: hour field ``*`` (croniter folds ``0-23`` and ``*/1`` into ``*``).
        self.every_hour = self.expanded[1] == ["*"]
        self._lock = threading.Lock()
        #: the last (after_ms, answer) of next_after
        self._last: tuple[int, int | None] | None = None

    def describe(self) -> str:
        """``cron '*/5 * * * *' (POSIX) Europe/Berlin``."""
        meaning = "POSIX" if self.day_or else "day-of-month AND day-of-week"
        return f"{self.kind} '{self.expr}' ({meaning}) {_zone_name(self.zone)}"

    def next_after(self, after_ms: int) -> int | None:
        """The first slot strictly after ``after_ms``.

        The last answer is kept: jobs that share this object (one per
        distinct definition, see :func:`slots_for`) ask the same question
        at start-up and at each shared slot, and croniter answers it once.

        Args:
            after_ms: an instant, epoch milliseconds (UTC).

        Returns:
            The slot, epoch milliseconds (UTC), or None when croniter finds no
            further match (a year field that has run out).
        """
        last = self._last
        if last is not None and last[0] == after_ms:
            return last[1]
        found = self._next_after(after_ms)
        self._last = (after_ms, found)
        return found

    def _next_after(self, after_ms: int) -> int | None:
        # Slots are two increasing series: the first instant of each matching
        # wall time, and (hour field '*' only) the second pass of a repeated
        # wall time. The second series can only come first while `after` lies
        # inside a repeated band, so it is looked at only then.
        after = after_ms // 1000  # slots are whole seconds
        local = _local(after, self.zone)
        wall = local.replace(tzinfo=None)
        band = self._repeated_hour(after, local)
        start = wall
        if band is not None and local.fold == 1:
            # In the second pass of a repeated hour: the first occurrences of
            # its wall times are behind us, the next lies past the hour.
            start = band[1] - _SECOND
        found = []
        first = self._next_wall(start)
        if first is not None:
            found.append(self._first_instant(first))
        if band is not None and self.every_hour:
            second = self._second_pass(band, wall if local.fold == 1 else band[0] - _SECOND)
            if second is not None:
                found.append(second)
        return min(found) * 1000 if found else None

    def _next_wall(self, after: datetime) -> datetime | None:
        """The first matching wall time strictly after ``after`` (naive, local)."""
        with self._lock:
            try:
                wall: datetime = self._iter.get_next(datetime, start_time=after)
            except CroniterBadDateError:
                return None
        return wall

    def _first_instant(self, wall: datetime) -> int:
        """The instant a matching wall time fires at, epoch seconds.

        The wall time itself when it exists once, its first occurrence when it
        is repeated, the end of the gap when it does not exist.
        """
        seconds = (wall - _NAIVE_EPOCH) // _SECOND
        early = _offset(wall.replace(tzinfo=self.zone, fold=0))
        late = _offset(wall.replace(tzinfo=self.zone, fold=1))
        if early >= late:  # one occurrence, or the first of two
            return seconds - early
        # In a gap, fold=0 reads the wall time with the offset from before the
        # jump, which lands after it, fold=1 with the one after, which lands
        # before it (PEP 495): the jump lies between.
        return _transition(self.zone, seconds - late, seconds - early)

    def _repeated_hour(self, after: int, local: datetime) -> tuple[datetime, datetime, int] | None:
        """The repeated wall-time band that instant ``after`` is in, if any.

        Returns:
            ``(start, end, offset)`` for a fall-back transition whose repeated
            wall times ``[start, end)`` (naive, local) include the wall time of
            ``after``; ``offset`` is the UTC offset of the second pass, seconds.
            None when the wall time of ``after`` occurs once.
        """
        before = _offset(local.replace(fold=0))
        after_jump = _offset(local.replace(fold=1))
        if before <= after_jump:
            return None
        shift = before - after_jump
        if local.fold == 0:
            jump = _transition(self.zone, after, after + shift)
        else:
            jump = _transition(self.zone, after - shift, after)
        start = _NAIVE_EPOCH + timedelta(seconds=jump + after_jump)
        return start, start + timedelta(seconds=shift), after_jump

    def _second_pass(self, band: tuple[datetime, datetime, int], after: datetime) -> int | None:
        """The second-pass instant of the first matching wall time after ``after``.

        Only jobs whose hour field is ``*`` fire in the second pass of a
        repeated hour. Returns epoch seconds, or None when no matching wall
        time of the band is left.
        """
        _, end, offset = band
        wall = self._next_wall(after)
        if wall is None or wall >= end:
            return None
        return (wall - _NAIVE_EPOCH) // _SECOND - offset


def _local(seconds: int, zone: tzinfo) -> datetime:
    """Instant ``seconds`` (epoch) as an aware local datetime, ``fold`` set (PEP 495)."""
    return (_EPOCH + timedelta(seconds=seconds)).astimezone(zone)


def _offset(local: datetime) -> int:
    """UTC offset of an aware datetime, whole seconds."""
    offset = local.utcoffset()
    assert offset is not None
    return offset // _SECOND


def _transition(zone: tzinfo, low: int, high: int) -> int:
    """The instant the UTC offset of ``zone`` changes, in ``(low, high]``.

    Bisection over epoch seconds; ``low`` and ``high`` must have different
    offsets (one transition between them).
    """
    before = _offset(_local(low, zone))
    while high - low > 1:
        middle = (low + high) // 2
        if _offset(_local(middle, zone)) == before:
            low = middle
        else:
            high = middle
    return high


class SolarSlots:
    """Slots at a sun event (celery's ``solar``), computed with ``ephem``.

    Each slot is the first event after the previous one. ephem's own search
    returns times that move by a few milliseconds with the search's starting
    point, so two hosts could disagree on a slot; here ephem only locates the
    event, then the instant is fixed by bisection, to the millisecond, on a
    one-minute bracket of a fixed grid: the same on every host. If no such
    bracket is found next to ephem's time (an event that barely happens),
    ephem's time rounded to the second is used.

    Args:
        event: celery's event name (``sunrise``, ``solar_noon``, ...).
        lat: latitude, degrees.
        lon: longitude, degrees.
        method: ephem's search (``next_rising``, ``next_setting``, ``next_transit``).
        horizon: the horizon altitude, radians.
        use_center: track the sun's centre rather than its upper limb.
        ephem: the ``ephem`` module.
    """

    #: Grid of the bisection bracket, milliseconds.
    GRID_MS = 60_000
    #: Days searched for an event that does not happen every day (polar regions).
    MAX_SEARCH_DAYS = 366

    def __init__(
        self,
        event: str,
        lat: float,
        lon: float,
        *,
        method: str,
        horizon: float,
        use_center: bool,
        ephem: Any,
    ) -> None:
        self.event = event
        self.lat = lat
        self.lon = lon
        self._method = method
        self._use_center = use_center
        self._ephem = ephem
        self._epoch_days = float(ephem.Date("1970/1/1"))
        self._observer = ephem.Observer()
        self._observer.lat = str(lat)
        self._observer.lon = str(lon)
        self._observer.elev = 0
        self._observer.pressure = 0
        self._observer.horizon = horizon
        self._horizon = float(self._observer.horizon)
        self._sun = ephem.Sun()
        self._lock = threading.Lock()

    def describe(self) -> str:
        """``solar sunrise at latitude 52.52, longitude 13.405``."""
        return f"solar {self.event} at latitude {self.lat}, longitude {self.lon}"

    def next_after(self, after_ms: int) -> int | None:
        """The first event strictly after ``after_ms`` (epoch ms UTC), or None.

        None when the event does not happen within :attr:`MAX_SEARCH_DAYS`.
        """
        with self._lock:
            start = after_ms - self.GRID_MS  # so an event just after after_ms is seen
            while True:
                rough = self._rough_event(start)
                if rough is None:
                    return None
                slot = self._exact_event(rough)
                if slot > after_ms:
                    return slot
                start = max(slot, rough) + self.GRID_MS

    def _rough_event(self, start_ms: int) -> int | None:
        """ephem's time of the first event after ``start_ms``, epoch ms."""
        start = self._ephem.Date(self._epoch_days + start_ms / 86_400_000)
        search = getattr(self._observer, self._method)
        options = {"use_center": True} if self._use_center else {}
        for _ in range(self.MAX_SEARCH_DAYS):
            try:
                found = search(self._sun, start=start, **options)
            except self._ephem.CircumpolarError:
                start = self._observer.next_antitransit(self._sun, start=start)
                continue
            return round((float(found) - self._epoch_days) * 86_400_000)
        return None

    def _exact_event(self, rough_ms: int) -> int:
        """The event next to ``rough_ms``, fixed to the millisecond, epoch ms."""
        grid = self.GRID_MS
        low = rough_ms // grid * grid
        for _ in range(3):
            if self._level(low) < 0:
                break
            low -= grid
        for _ in range(3):
            if self._level(low) < 0 <= self._level(low + grid):
                break
            low += grid
        else:
            return round(rough_ms, -3)
        high = low + grid  # level(low) < 0 <= level(high)
        while high - low > 1:
            middle = (low + high) // 2
            if self._level(middle) < 0:
                low = middle
            else:
                high = middle
        return high

    def _level(self, ms: int) -> float:
        """Crosses zero upwards at the event: a function of the sun at ``ms``."""
        self._observer.date = self._ephem.Date(self._epoch_days + ms / 86_400_000)
        self._sun.compute(self._observer)
        if self._method == "next_transit":
            return math.sin(float(self._sun.ha))
        height = float(self._sun.alt) - self._horizon
        if not self._use_center:
            height += float(self._sun.radius)
        return height if self._method == "next_rising" else -height


def _config_error(job: str, problem: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"beat_schedule[{job!r}]['schedule']: {problem}. Fix: {fix}.")


def _zone(value: object, job: str) -> tzinfo:
    """A zone from a name, a ZoneInfo, a pytz zone or any PEP 495 tzinfo."""
    name = value if isinstance(value, str) else getattr(value, "zone", None)
    if isinstance(name, str):  # a name, or a pytz zone (no PEP 495 folds)
        try:
            return ZoneInfo(name)
        except (ZoneInfoNotFoundError, ValueError):
            raise _config_error(
                job, f"unknown time zone {name!r}", "use an IANA name such as 'Europe/Berlin'"
            )
    if isinstance(value, tzinfo):
        return value
    raise _config_error(job, f"time zone {value!r} is not a tzinfo", "give an IANA zone name")


def _interval_ms(seconds: float, job: str) -> int:
    if not math.isfinite(seconds) or round(seconds * 1000) <= 0:
        raise _config_error(
            job,
            f"interval {seconds!r} s is not a positive number of milliseconds",
            "give an interval of at least 0.001 s",
        )
    return round(seconds * 1000)


def _cron_slots(expr: str, zone: tzinfo, job: str, *, day_or: bool, kind: str) -> CronSlots:
    fields = expr.split()
    if any(_RANDOM_FIELD.match(field) for field in fields):
        raise _config_error(
            job,
            f"cron {expr!r} uses R (random), which differs on every host",
            "use H (hashed from the job name, the same on every host) or a fixed value",
        )
    hash_id = None if expr.startswith("@") else job  # '@daily' with a hash_id is hashed
    try:
        slots = CronSlots(expr, zone, day_or=day_or, hash_id=hash_id, kind=kind)
    except (CroniterError, ValueError, TypeError) as exc:
        if 5 <= len(fields) <= 7:
            fix = (
                "each field within its range: minute 0-59, hour 0-23, day-of-month 1-31, "
                "month 1-12, day-of-week 0-6 (Sunday 0), seconds (6th) 0-59"
            )
        else:
            fix = (
                "give 5 fields 'minute hour day-of-month month day-of-week', "
                "6 with seconds last, 7 with a year last, or an alias such as '@daily'"
            )
        raise _config_error(
            job, f"cannot read cron {expr!r} ({str(exc).rstrip('.')})", fix
        ) from exc
    return slots


def _crontab_expr(schedule: schedules.crontab) -> str:
    """A croniter expression from crontab's expanded sets (0 = Sunday, as in cron)."""
    fields = [
        (schedule.minute, 60),
        (schedule.hour, 24),
        (schedule.day_of_month, 31),
        (schedule.month_of_year, 12),
        (schedule.day_of_week, 7),
    ]
    return " ".join(
        "*" if len(values) == size else ",".join(str(v) for v in sorted(values))
        for values, size in fields
    )


def _solar_slots(schedule: schedules.solar, job: str) -> SolarSlots:
    try:
        import ephem
    except ImportError as exc:
        raise _config_error(
            job, "solar schedules need the ephem package", "pip install ephem"
        ) from exc
    return SolarSlots(
        schedule.event,
        schedule.lat,
        schedule.lon,
        method=schedule.method,
        horizon=float(schedule.cal.horizon),
        use_center=schedule.use_center,
        ephem=ephem,
    )


def _aware_ms(at: datetime, job: str) -> int:
    if at.tzinfo is None or at.utcoffset() is None:
        raise _config_error(
            job,
            f"one-off datetime {at.isoformat()} is naive",
            "give it a time zone, e.g. datetime(..., tzinfo=ZoneInfo('UTC'))",
        )
    return to_ms(at)


def _build(schedule: object, job: str, tz: tzinfo, anchor_ms: int) -> Slots:
    """The slots of ``schedule``, without the never-matches check."""
    if isinstance(schedule, cron):
        zone = _zone(schedule.zone, job) if schedule.zone is not None else tz
        return _cron_slots(schedule.expr, zone, job, day_or=True, kind="cron")
    if isinstance(schedule, oneoff):
        return OneoffSlots(_aware_ms(schedule.at, job))
    if isinstance(schedule, str):
        return _cron_slots(" ".join(schedule.split()), tz, job, day_or=True, kind="cron")
    if isinstance(schedule, schedules.crontab):
        own = vars(schedule).get("tz")  # set on the entry, or cached from its app
        zone = _zone(own, job) if own is not None else tz
        return _cron_slots(_crontab_expr(schedule), zone, job, day_or=False, kind="crontab")
    if isinstance(schedule, schedules.schedule):
        return _build(schedule.run_every, job, tz, anchor_ms)
    if isinstance(schedule, timedelta):
        return IntervalSlots(_interval_ms(schedule / _SECOND, job), anchor_ms)
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return IntervalSlots(_interval_ms(schedule, job), anchor_ms)
    if isinstance(schedule, schedules.solar):
        return _solar_slots(schedule, job)
    if isinstance(schedule, datetime):
        return OneoffSlots(_aware_ms(schedule, job))
    raise _config_error(
        job,
        f"unsupported schedule {schedule!r} ({type(schedule).__name__})",
        "use crontab(...), a cron string such as '*/5 * * * *', a timedelta or "
        "seconds, solar(...), or a timezone-aware datetime",
    )


def slots_for(
    schedule: object,
    *,
    job: str,
    tz: tzinfo,
    anchor_ms: int = 0,
    shared: dict[Any, Slots] | None = None,
) -> Slots:
    """The slots of a ``beat_schedule`` entry's schedule.

    Args:
        schedule: a ``crontab``, a cron string (5 fields; 6 with seconds last;
            an ``@`` alias), a :class:`cron`, a ``timedelta`` or number of
            seconds or ``celery.schedules.schedule`` (``relative=True`` is
            ignored: slots stay anchored), a ``solar``, an aware ``datetime``
            or a :class:`oneoff`.
        job: the entry's name, for error messages and ``H`` cron fields.
        tz: the app's zone, used unless the schedule carries its own (a
            ``tz`` set on the crontab, ``cron(tz=...)``).
        anchor_ms: one slot of an interval series, epoch milliseconds (UTC);
            other kinds ignore it.
        shared: a dict kept across the calls for one schedule (the jobs of
            an app): cron schedules of the same expression, meaning and zone
            (and job name, where ``H`` or a name makes it matter) get one
            :class:`CronSlots` object, built and checked once.

    Returns:
        The job's :class:`Slots`; keep it, it caches its cron parser.

    Raises:
        ConfigurationError: naming the job, the setting and the fix, for a cron
            string croniter cannot read or that never matches (``0 0 31 2
            *``), an interval of zero or less, a naive datetime, an unknown
            zone or schedule type, solar without ``ephem``.
    """
    key = _share_key(schedule, job, tz) if shared is not None else None
    if key is not None and shared is not None and key in shared:
        return shared[key]
    slots = _build(schedule, job, tz, anchor_ms)
    if (
        isinstance(slots, CronSlots)
        and not _surely_matches(slots)
        and slots.next_after(anchor_ms) is None
    ):
        raise _config_error(
            job,
            f"{slots.kind} '{slots.expr}' never matches a date "
            f"(croniter finds none within {_MAX_YEARS} years)",
            "check the day-of-month and month fields, e.g. 31 in February",
        )
    if key is not None and shared is not None:
        shared[key] = slots
    return slots


def _share_key(schedule: object, job: str, tz: tzinfo) -> tuple[Any, ...] | None:
    """What decides a cron schedule's slots, as a dict key (None for other
    kinds: they are cheap to build). The job name is part of it when the
    expression has an ``h`` in a field (``H`` is hashed from the name;
    names such as ``thu`` are kept apart too, to be safe)."""
    if isinstance(schedule, cron):
        expr: str = schedule.expr
        zone: object = _zone_name_of(schedule.zone) if schedule.zone is not None else tz
        kind = "cron"
    elif isinstance(schedule, str):
        expr, zone, kind = " ".join(schedule.split()), tz, "cron"
    elif isinstance(schedule, schedules.crontab):
        own = vars(schedule).get("tz")
        expr, zone, kind = _crontab_expr(schedule), tz if own is None else own, "crontab"
    else:
        return None
    key = (kind, expr, zone, job if "h" in expr.lower() else None)
    try:
        hash(key)
    except TypeError:  # a zone object that cannot be a key: no sharing
        return None
    return key


def _surely_matches(slots: CronSlots) -> bool:
    """Whether the expression matches some date for sure, read from its
    fields alone (no year field, and a day-of-month field that is ``*`` or
    holds a day every month has), so the check by computing a slot from the
    anchor is needed only for the rest (``0 0 31 2 *``, year fields, ``L``,
    ``W``)."""
    expanded = slots.expanded
    if len(expanded) > 6:
        return False
    days = expanded[2]
    if days == ["*"]:
        return True
    return all(isinstance(day, int) for day in days) and min(days) <= 28


def first_slot(slots: Slots, now_ms: int, max_late_ms: int) -> int | None:
    """The first slot a starting process acts on: the first after ``now - max_late``.

    A process that just started never records older slots as missed.

    Args:
        slots: the job's slots.
        now_ms: the current instant, epoch milliseconds (UTC).
        max_late_ms: how late a slot may still be sent, milliseconds.

    Returns:
        The slot, epoch milliseconds (UTC), or None when there is none.
    """
    return slots.next_after(now_ms - max_late_ms)


def definition(schedule: object, tz: tzinfo, anchor_ms: int = 0, *, job: str = "") -> str:
    """A stable text of a schedule: same schedule, same text on every host.

    For fingerprinting a job's definition. Built from :meth:`Slots.describe`,
    so it names what decides the slots (expression, meaning, zone, interval,
    anchor) and nothing else; the job name is not in it.

    Raises:
        ConfigurationError: as :func:`slots_for`.
    """
    return slots_for(schedule, job=job, tz=tz, anchor_ms=anchor_ms).describe()


class _SlotSchedule(schedules.BaseSchedule):
    """Celery's schedule interface on top of :class:`Slots`.

    So that :class:`cron` and :class:`oneoff` also behave under Celery's own
    beat machinery (``is_due``, ``remaining_estimate``).
    """

    _cache: tuple[tzinfo, Slots] | None = None

    def _slots(self) -> Slots:
        zone = self.tz
        if self._cache is None or self._cache[0] is not zone:
            self._cache = (zone, slots_for(self, job=repr(self), tz=zone))
        return self._cache[1]

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        """Time from now to the first slot after ``last_run_at`` (naive means UTC).

        Ten years when there is none.
        """
        last = self.maybe_make_aware(last_run_at)
        slot = self._slots().next_after(to_ms(last))
        if slot is None:
            return _NEVER
        remaining: timedelta = from_ms(slot) - self.maybe_make_aware(self.now())
        return remaining

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        """Celery's ``(is_due, seconds until the next check)``.

        Due when a slot lies between ``last_run_at`` and now; the next check
        is then the time to the slot after now.
        """
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if remaining > 0:
            return schedules.schedstate(False, remaining)
        following = self.remaining_estimate(self.now()).total_seconds()
        return schedules.schedstate(True, max(following, 0.0))


class cron(_SlotSchedule):
    """A cron expression as a Celery schedule, read by croniter with POSIX meaning.

    ``'schedule': cron('*/5 * * * *', tz='Europe/Berlin')``. When both the
    day-of-month and the day-of-week field are restricted, a day matching
    either fires (crontab(5)); ``celery.schedules.crontab`` needs both.
    Six fields put the seconds last (``'* * * * * */2'``: every 2 s).

    The expression is checked when the job is added (:func:`slots_for`), so
    the error names the job.

    Args:
        expr: the expression, as croniter reads it.
        tz: the zone of its wall clock (a name or a tzinfo); default the app's.
        nowfun: Celery's clock override, for Celery's own machinery.
        app: the Celery app.
    """

    def __init__(
        self,
        expr: str,
        tz: str | tzinfo | None = None,
        nowfun: Callable[[], datetime] | None = None,
        app: Any = None,
    ) -> None:
        if not isinstance(expr, str):
            raise TypeError(f"cron() takes an expression string, got {expr!r}")
        super().__init__(nowfun=nowfun, app=app)
        self.expr = " ".join(expr.split())
        self.zone = tz

    @property
    def tz(self) -> tzinfo:
        """The zone slots are computed in: the given one, else the app's."""
        if self.zone is not None:
            return _zone(self.zone, repr(self))
        zone: tzinfo = self.app.timezone
        return zone

    def __repr__(self) -> str:
        if self.zone is None:
            return f"cron({self.expr!r})"
        return f"cron({self.expr!r}, tz={_zone_name_of(self.zone)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, cron):
            return NotImplemented
        return self.expr == other.expr and _zone_name_of(self.zone) == _zone_name_of(other.zone)

    def __hash__(self) -> int:
        return hash((self.expr, _zone_name_of(self.zone)))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (self.expr, self.zone, self.nowfun)


class oneoff(_SlotSchedule):
    """One run at a timezone-aware instant, as a Celery schedule.

    ``'schedule': oneoff(datetime(2026, 6, 1, 12, tzinfo=ZoneInfo('Europe/Berlin')))``.
    A naive datetime is refused when the job is added (:func:`slots_for`),
    so the error names the job.

    Args:
        at: the instant.
        nowfun: Celery's clock override, for Celery's own machinery.
        app: the Celery app.
    """

    def __init__(
        self,
        at: datetime,
        nowfun: Callable[[], datetime] | None = None,
        app: Any = None,
    ) -> None:
        if not isinstance(at, datetime):
            raise TypeError(f"oneoff() takes a datetime, got {at!r}")
        super().__init__(nowfun=nowfun, app=app)
        self.at = at

    def __repr__(self) -> str:
        return f"oneoff({self.at!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, oneoff):
            return NotImplemented
        return self.at == other.at

    def __hash__(self) -> int:
        return hash(self.at)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (self.at, self.nowfun)


def _zone_name_of(zone: str | tzinfo | None) -> str | None:
    if zone is None or isinstance(zone, str):
        return zone
    return _zone_name(zone)
