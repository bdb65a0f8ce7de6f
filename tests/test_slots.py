"""Slot arithmetic: fixed clocks, DST vectors, and properties over many hosts.

Every time here is fixed; nothing sleeps or reads the clock. Slots are epoch
milliseconds (UTC) as everywhere in the package.
"""

from __future__ import annotations

import functools
import itertools
import math
import pickle
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab, schedule, solar
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.slots import (
    CronSlots,
    IntervalSlots,
    OneoffSlots,
    Slots,
    cron,
    definition,
    first_slot,
    from_ms,
    oneoff,
    slots_for,
    to_ms,
)

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
LONDON = ZoneInfo("Europe/London")
LOS_ANGELES = ZoneInfo("America/Los_Angeles")
NEW_YORK = ZoneInfo("America/New_York")
SANTIAGO = ZoneInfo("America/Santiago")
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def utc_ms(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """Epoch ms of a UTC date and time."""
    return to_ms(datetime(year, month, day, hour, minute, second, tzinfo=UTC))


def local_ms(
    zone: ZoneInfo, year: int, month: int, day: int, hour: int = 0, minute: int = 0
) -> int:
    """Epoch ms of a local wall time in ``zone`` (its first occurrence)."""
    return to_ms(datetime(year, month, day, hour, minute, tzinfo=zone))


def walk(slots: Slots, after_ms: int, count: int) -> list[int]:
    """The next ``count`` slots after ``after_ms`` (fewer if the schedule ends)."""
    found: list[int] = []
    previous = after_ms
    while len(found) < count:
        slot = slots.next_after(previous)
        if slot is None:
            break
        assert slot > previous, f"next_after({previous}) went back to {slot}"
        found.append(slot)
        previous = slot
    return found


def walk_until(slots: Slots, after_ms: int, end_ms: int) -> list[int]:
    """Every slot in ``(after_ms, end_ms]``."""
    found: list[int] = []
    previous, slot = after_ms, slots.next_after(after_ms)
    while slot is not None and slot <= end_ms:
        assert slot > previous, f"next_after({previous}) went back to {slot}"
        found.append(slot)
        previous, slot = slot, slots.next_after(slot)
    return found


# --- DST vectors ---------------------------------------------------------------


def test_berlin_spring_forward_fixed_hour_fires_at_end_of_gap() -> None:
    slots = slots_for("30 2 * * *", job="nightly", tz=BERLIN)
    last = local_ms(BERLIN, 2026, 3, 28, 2, 30)
    assert walk(slots, last, 2) == [utc_ms(2026, 3, 29, 1, 0), utc_ms(2026, 3, 30, 0, 30)]
    assert from_ms(utc_ms(2026, 3, 29, 1, 0)).astimezone(BERLIN).hour == 3  # 03:00 CEST


def test_london_fall_back_fixed_hour_fires_first_occurrence_only() -> None:
    slots = slots_for("30 1 * * *", job="nightly", tz=LONDON)
    last = local_ms(LONDON, 2026, 10, 24, 1, 30)
    assert walk(slots, last, 2) == [utc_ms(2026, 10, 25, 0, 30), utc_ms(2026, 10, 26, 1, 30)]


def test_los_angeles_hourly_crontab_follows_both_repeated_hours() -> None:
    slots = slots_for(crontab(minute=0), job="hourly", tz=LOS_ANGELES)
    hours = [7, 8, 9, 10]
    assert walk(slots, utc_ms(2026, 11, 1, 6, 30), 4) == [utc_ms(2026, 11, 1, h) for h in hours]
    day_start = local_ms(LOS_ANGELES, 2026, 11, 1)
    day_end = local_ms(LOS_ANGELES, 2026, 11, 2)
    assert len(walk_until(slots, day_start - 1, day_end - 1)) == 25


def test_new_york_2015_fall_back_crontab_fires_once_at_17() -> None:
    slots = slots_for(crontab(hour=17, minute=0), job="evening", tz=NEW_YORK)
    day = walk_until(slots, local_ms(NEW_YORK, 2015, 11, 1) - 1, local_ms(NEW_YORK, 2015, 11, 2))
    assert day == [utc_ms(2015, 11, 1, 22)]


def test_london_half_hourly_in_named_hour_fires_first_occurrences_only() -> None:
    slots = slots_for("*/30 1 * * *", job="early", tz=LONDON)
    day = walk_until(slots, utc_ms(2026, 10, 24, 23), utc_ms(2026, 10, 25, 23))
    assert day == [utc_ms(2026, 10, 25, 0, 0), utc_ms(2026, 10, 25, 0, 30)]


def test_every_hour_job_follows_real_time_through_repeated_hour() -> None:
    slots = slots_for("*/30 * * * *", job="half-hourly", tz=LONDON)
    slots_ = walk_until(slots, utc_ms(2026, 10, 24, 23, 59), utc_ms(2026, 10, 25, 2, 0))
    assert slots_ == [utc_ms(2026, 10, 25, 0) + k * HOUR_MS // 2 for k in range(5)]


def test_wall_times_inside_a_gap_are_one_slot_at_its_end() -> None:
    slots = slots_for("*/15 2 * * *", job="gap", tz=BERLIN)
    day = walk_until(slots, utc_ms(2026, 3, 28, 23), utc_ms(2026, 3, 29, 23))
    assert day == [utc_ms(2026, 3, 29, 1, 0)]


def test_every_hour_job_in_a_gap_fires_at_its_end_once() -> None:
    # 02:30 does not exist: it fires at the end of the gap (03:00 CEST), and
    # the gap's end is one slot even where 03:00 itself matches.
    half_past = slots_for("30 * * * *", job="half-past", tz=BERLIN)
    on_the_hour = slots_for("0 * * * *", job="on-the-hour", tz=BERLIN)
    start, end = utc_ms(2026, 3, 29, 0), utc_ms(2026, 3, 29, 2)
    assert walk_until(half_past, start, end) == [
        utc_ms(2026, 3, 29, 0, 30),
        utc_ms(2026, 3, 29, 1, 0),
        utc_ms(2026, 3, 29, 1, 30),
    ]
    assert walk_until(on_the_hour, start, end) == [utc_ms(2026, 3, 29, 1), utc_ms(2026, 3, 29, 2)]


def test_midnight_that_does_not_exist_fires_at_end_of_gap() -> None:
    # Chile springs forward at 00:00 (to 01:00) on 2026-09-06.
    slots = slots_for("0 0 * * *", job="midnight", tz=SANTIAGO)
    assert walk(slots, utc_ms(2026, 9, 5, 12), 2) == [
        utc_ms(2026, 9, 6, 4, 0),
        local_ms(SANTIAGO, 2026, 9, 7),
    ]


def test_repeated_hour_across_midnight() -> None:
    # Chile falls back at 00:00 (to 23:00 the day before) on 2026-04-05.
    named = slots_for("30 23 * * *", job="late", tz=SANTIAGO)
    every_hour = slots_for("30 * * * *", job="late-hourly", tz=SANTIAGO)
    start, end = utc_ms(2026, 4, 5, 1), utc_ms(2026, 4, 5, 5)
    assert walk_until(named, start, end) == [utc_ms(2026, 4, 5, 2, 30)]
    assert walk_until(every_hour, start, end) == [utc_ms(2026, 4, 5, h, 30) for h in (1, 2, 3, 4)]


# --- intervals --------------------------------------------------------------------


def test_interval_two_hosts_started_apart_share_the_phase() -> None:
    minute = timedelta(minutes=1)
    host_a = slots_for(minute, job="tick", tz=UTC)
    host_b = slots_for(minute, job="tick", tz=UTC)
    started_a = utc_ms(2026, 5, 4, 14, 5, 43)
    started_b = utc_ms(2026, 5, 4, 14, 6, 10)
    max_late = 30_000
    expected = [utc_ms(2026, 5, 4, 14, 6), utc_ms(2026, 5, 4, 14, 7), utc_ms(2026, 5, 4, 14, 8)]
    for slots, started in ((host_a, started_a), (host_b, started_b)):
        first = first_slot(slots, started, max_late)
        assert first is not None
        assert [first, *walk(slots, first, 2)] == expected


def test_interval_restart_does_not_move_the_phase() -> None:
    slots = slots_for(90, job="tick", tz=UTC)
    before = walk(slots, utc_ms(2026, 5, 4, 14, 5, 43), 10)
    restart = utc_ms(2026, 5, 4, 14, 9, 1)
    restarted = slots_for(90, job="tick", tz=UTC)
    assert walk(restarted, restart, 5) == [slot for slot in before if slot > restart][:5]
    assert all(slot % 90_000 == 0 for slot in before)


def test_weekly_interval_fires_on_thursdays_whatever_the_restart_day() -> None:
    weekly = timedelta(days=7)
    seen = set()
    for day in range(1, 15):  # beat restarts every day for two weeks
        slots = slots_for(weekly, job="weekly", tz=UTC)
        slot = slots.next_after(utc_ms(2026, 6, day, 9))
        assert slot is not None
        when = from_ms(slot)
        assert (when.isoweekday(), when.hour, when.minute) == (4, 0, 0)  # Thursday 00:00 UTC
        seen.add(slot)
    assert sorted(seen) == [utc_ms(2026, 6, 4), utc_ms(2026, 6, 11), utc_ms(2026, 6, 18)]


def test_interval_anchor_sets_the_phase() -> None:
    anchor = utc_ms(2026, 1, 1, 0, 0, 7)
    slots = slots_for(timedelta(minutes=5), job="tick", tz=UTC, anchor_ms=anchor)
    assert walk(slots, utc_ms(2026, 3, 1, 12, 1), 2) == [
        utc_ms(2026, 3, 1, 12, 5, 7),
        utc_ms(2026, 3, 1, 12, 10, 7),
    ]


def test_interval_has_millisecond_precision() -> None:
    slots = slots_for(0.25, job="fast", tz=UTC)
    assert walk(slots, 1_000, 3) == [1_250, 1_500, 1_750]
    assert slots_for(timedelta(milliseconds=1500), job="fast", tz=UTC).next_after(-1) == 0
    assert slots_for(1.5, job="fast", tz=UTC).next_after(2_999) == 3_000


def test_celery_schedule_uses_run_every_and_ignores_relative() -> None:
    for relative in (False, True):
        slots = slots_for(schedule(timedelta(seconds=30), relative=relative), job="j", tz=UTC)
        assert isinstance(slots, IntervalSlots)
        assert walk(slots, utc_ms(2026, 1, 1, 0, 0, 10), 2) == [
            utc_ms(2026, 1, 1, 0, 0, 30),
            utc_ms(2026, 1, 1, 0, 1, 0),
        ]


# --- start-up ---------------------------------------------------------------------


def test_first_slot_is_the_first_after_now_minus_max_late() -> None:
    slots = slots_for("*/5 * * * *", job="five", tz=UTC)
    now = utc_ms(2026, 1, 1, 12, 6, 30)
    assert first_slot(slots, now, 60_000) == utc_ms(2026, 1, 1, 12, 10)
    assert first_slot(slots, now, 120_000) == utc_ms(2026, 1, 1, 12, 5)
    assert first_slot(slots, now, 0) == utc_ms(2026, 1, 1, 12, 10)


def test_next_after_is_strictly_after() -> None:
    slots = slots_for("*/5 * * * *", job="five", tz=BERLIN)
    slot = utc_ms(2026, 1, 1, 12, 5)
    assert slots.next_after(slot - 1) == slot
    assert slots.next_after(slot - 999) == slot
    assert slots.next_after(slot) == slot + 300_000
    assert slots.next_after(slot + 1) == slot + 300_000


# --- cron strings and crontab -----------------------------------------------------


def test_six_fields_put_seconds_last_every_two_seconds() -> None:
    slots = slots_for("* * * * * */2", job="fast", tz=UTC)
    start = utc_ms(2026, 1, 1, 12, 0, 59)
    assert walk(slots, start, 4) == [utc_ms(2026, 1, 1, 12, 1, s) for s in (0, 2, 4, 6)]


def test_crontab_needs_day_of_month_and_day_of_week() -> None:
    friday_13th = crontab(minute=0, hour=0, day_of_month=13, day_of_week=5)
    slots = slots_for(friday_13th, job="spooky", tz=UTC)
    assert walk(slots, utc_ms(2026, 1, 1), 3) == [
        utc_ms(2026, 2, 13),
        utc_ms(2026, 3, 13),
        utc_ms(2026, 11, 13),
    ]


def test_cron_string_takes_day_of_month_or_day_of_week() -> None:
    slots = slots_for("0 0 13 * 5", job="spooky", tz=UTC)
    assert walk(slots, utc_ms(2026, 1, 1), 5) == [
        utc_ms(2026, 1, 2),  # Friday
        utc_ms(2026, 1, 9),  # Friday
        utc_ms(2026, 1, 13),  # Tuesday the 13th
        utc_ms(2026, 1, 16),  # Friday
        utc_ms(2026, 1, 23),  # Friday
    ]


def test_crontab_day_of_week_zero_is_sunday() -> None:
    slots = slots_for(crontab(minute=0, hour=12, day_of_week=0), job="sunday", tz=UTC)
    slot = slots.next_after(utc_ms(2026, 1, 1))
    assert slot == utc_ms(2026, 1, 4, 12)
    assert from_ms(slot).isoweekday() == 7


def test_croniter_extensions_and_aliases() -> None:
    daily = slots_for("@daily", job="d", tz=BERLIN)
    assert daily.next_after(utc_ms(2026, 1, 1)) == local_ms(BERLIN, 2026, 1, 2)
    last_day = slots_for("0 0 L * *", job="l", tz=UTC)
    assert last_day.next_after(utc_ms(2026, 2, 1)) == utc_ms(2026, 2, 28)
    third_friday = slots_for("0 9 * * 5#3", job="n", tz=UTC)
    assert third_friday.next_after(utc_ms(2026, 1, 1)) == utc_ms(2026, 1, 16, 9)


def test_hashed_field_is_fixed_by_the_job_name() -> None:
    first = slots_for("H * * * *", job="report-a", tz=UTC)
    again = slots_for("H * * * *", job="report-a", tz=UTC)
    start = utc_ms(2026, 1, 1)
    assert walk(first, start, 3) == walk(again, start, 3)
    minutes = {
        from_ms(slots_for("H * * * *", job=f"job-{n}", tz=UTC).next_after(start) or 0).minute
        for n in range(20)
    }
    assert len(minutes) > 5  # spread over the hour by job name


def test_year_field_runs_out() -> None:
    slots = slots_for("0 12 1 1 * 0 2030", job="once-2030", tz=UTC)
    assert walk(slots, utc_ms(2026, 1, 1), 3) == [utc_ms(2030, 1, 1, 12)]


def test_crontab_zone_set_on_the_schedule_wins() -> None:
    entry = crontab(minute=0, hour=9)
    entry.tz = ZoneInfo("Asia/Tokyo")
    slots = slots_for(entry, job="tokyo", tz=BERLIN)
    assert slots.next_after(utc_ms(2025, 12, 31, 12)) == utc_ms(2026, 1, 1, 0)  # 09:00 JST


def test_cron_object_zone_wins_over_the_app_zone() -> None:
    slots = slots_for(cron("0 9 * * *", tz="Asia/Tokyo"), job="tokyo", tz=BERLIN)
    assert slots.next_after(utc_ms(2025, 12, 31, 12)) == utc_ms(2026, 1, 1, 0)
    plain = slots_for(cron("0 9 * * *"), job="berlin", tz=BERLIN)
    assert plain.next_after(utc_ms(2026, 1, 1)) == utc_ms(2026, 1, 1, 8)


# --- one-off ----------------------------------------------------------------------


def test_oneoff_datetime_fires_once() -> None:
    at = datetime(2026, 6, 1, 12, tzinfo=BERLIN)
    for entry in (at, oneoff(at)):
        slots = slots_for(entry, job="launch", tz=UTC)
        assert isinstance(slots, OneoffSlots)
        assert slots.next_after(utc_ms(2026, 1, 1)) == utc_ms(2026, 6, 1, 10)
        assert slots.next_after(utc_ms(2026, 6, 1, 10)) is None


# --- errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, words",
    [
        ("0 0 31 2 *", "never matches"),
        ("not a cron", "cannot read cron"),
        ("61 * * * *", "cannot read cron"),
        ("R * * * *", "random"),
        (timedelta(0), "interval"),
        (-5, "interval"),
        (math.nan, "interval"),
        (datetime(2026, 1, 1), "naive"),
        (oneoff(datetime(2026, 1, 1)), "naive"),
        (cron("0 0 31 2 *"), "never matches"),
        (cron("* * * * *", tz="Mars/Olympus_Mons"), "unknown time zone"),
        (True, "unsupported schedule"),
        (object(), "unsupported schedule"),
    ],
    # repr of object() holds an address: stable ids for pytest-xdist
    ids=lambda v: "object()" if type(v) is object else repr(v),
)
def test_bad_schedule_raises_configuration_error_naming_the_job(entry: object, words: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        slots_for(entry, job="nightly-report", tz=UTC)
    message = str(caught.value)
    assert "nightly-report" in message
    assert "'schedule'" in message
    assert words in message
    assert "Fix:" in message
    assert isinstance(caught.value, ValueError)


def test_solar_without_ephem_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ephem", None)  # import ephem now fails
    entry = solar.__new__(solar)
    entry.event, entry.lat, entry.lon = "sunrise", 52.5, 13.4
    with pytest.raises(ConfigurationError, match="pip install ephem") as caught:
        slots_for(entry, job="dawn", tz=UTC)
    assert "dawn" in str(caught.value)


# --- solar ------------------------------------------------------------------------


def test_solar_slots_agree_from_any_starting_point() -> None:
    pytest.importorskip("ephem")
    host_a = slots_for(solar("sunrise", 52.52, 13.405), job="dawn", tz=UTC)
    host_b = slots_for(solar("sunrise", 52.52, 13.405), job="dawn", tz=UTC)
    sequence = walk(host_a, utc_ms(2026, 6, 1), 4)
    assert from_ms(sequence[0]).replace(microsecond=0) == datetime(
        2026, 6, 1, 2, 49, 41, tzinfo=UTC
    )
    assert all(abs(b - a - DAY_MS) < HOUR_MS for a, b in itertools.pairwise(sequence))
    for minutes in range(0, 24 * 60, 97):  # other hosts, started at other times
        start = utc_ms(2026, 6, 1) + minutes * 60_000 + 12_345
        expected = [slot for slot in sequence if slot > start][:2]
        assert walk(host_b, start, len(expected)) == expected
    assert walk(host_b, sequence[0] - 1, 1) == sequence[:1]
    assert walk(host_b, sequence[0], 1) == sequence[1:2]


def test_solar_noon_and_polar_events() -> None:
    pytest.importorskip("ephem")
    noon = slots_for(solar("solar_noon", 0, 0), job="noon", tz=UTC)
    slot = noon.next_after(utc_ms(2026, 3, 20))
    assert slot is not None and abs(slot - utc_ms(2026, 3, 20, 12, 7)) < 120_000
    # Longyearbyen: no sunrise in the midnight sun of June; the next is in August.
    polar = slots_for(solar("sunrise", 78.2, 15.6), job="polar", tz=UTC)
    sunrise = polar.next_after(utc_ms(2026, 6, 21))
    assert sunrise is not None and from_ms(sunrise).month == 8


# --- descriptions, definitions, conversions --------------------------------------


def test_describe_texts() -> None:
    texts = {
        "every 60s from 1970-01-01T00:00:00Z": slots_for(60, job="j", tz=UTC),
        "every 0.5s from 1970-01-01T00:00:01.250Z": slots_for(
            0.5, job="j", tz=UTC, anchor_ms=1_250
        ),
        "cron '*/5 * * * *' (POSIX) Europe/Berlin": slots_for("*/5  * * * *", job="j", tz=BERLIN),
        "crontab '0 17 * * *' (day-of-month AND day-of-week) America/New_York": slots_for(
            crontab(minute=0, hour=17), job="j", tz=NEW_YORK
        ),
        "once at 2026-06-01T10:00:00Z": slots_for(
            datetime(2026, 6, 1, 12, tzinfo=BERLIN), job="j", tz=UTC
        ),
    }
    for text, slots in texts.items():
        assert slots.describe() == text


def test_definition_is_the_same_for_the_same_schedule() -> None:
    assert definition(60, UTC) == definition(timedelta(minutes=1), UTC)
    assert definition(60, UTC) == definition(schedule(60), BERLIN)  # zone does not matter
    assert definition(60, UTC) != definition(60, UTC, 5_000)
    assert definition(crontab(minute="*/5"), BERLIN) == definition(crontab(minute="*/5"), BERLIN)
    assert definition(crontab(minute="*/5"), BERLIN) != definition(crontab(minute="*/5"), UTC)
    assert definition("*/5 * * * *", BERLIN) == definition(cron("*/5 * * * *"), BERLIN)
    assert definition("0 0 13 * 5", UTC) != definition(
        crontab(minute=0, hour=0, day_of_month=13, day_of_week=5), UTC
    )


def test_ms_conversions() -> None:
    moment = datetime(2026, 3, 29, 3, 0, 0, 123000, tzinfo=BERLIN)
    assert to_ms(moment) == utc_ms(2026, 3, 29, 1) + 123
    assert from_ms(to_ms(moment)) == moment
    assert from_ms(0).tzinfo is UTC
    assert to_ms(datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)) == -1
    with pytest.raises(ValueError):
        to_ms(datetime(2026, 1, 1))


# --- the user-facing cron and oneoff schedules -------------------------------------


def test_cron_repr_eq_hash_and_pickle() -> None:
    every_5 = cron("*/5 * * * *", tz="Europe/Berlin")
    assert repr(every_5) == "cron('*/5 * * * *', tz='Europe/Berlin')"
    assert repr(cron("0 0 * * *")) == "cron('0 0 * * *')"
    assert every_5 == cron("*/5  *  * * *", tz=BERLIN)
    assert every_5 != cron("*/5 * * * *")
    assert every_5 != cron("*/5 * * * *", tz="UTC")
    assert hash(every_5) == hash(cron("*/5 * * * *", tz=BERLIN))
    copy = pickle.loads(pickle.dumps(every_5))
    assert copy == every_5
    assert copy.tz == BERLIN


def test_oneoff_repr_eq_and_pickle() -> None:
    at = datetime(2026, 6, 1, 12, tzinfo=UTC)
    launch = oneoff(at)
    assert launch == oneoff(at.astimezone(BERLIN))
    assert launch != oneoff(at + timedelta(seconds=1))
    assert repr(launch) == f"oneoff({at!r})"
    assert pickle.loads(pickle.dumps(launch)) == launch


def fixed_clock(moment: datetime) -> Callable[[], datetime]:
    return lambda: moment


def test_cron_is_due_under_celerys_own_machinery() -> None:
    last_run = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    early = cron(
        "*/5 * * * *", tz="UTC", nowfun=fixed_clock(datetime(2026, 1, 1, 12, 3, tzinfo=UTC))
    )
    assert early.is_due(last_run) == (False, 120.0)
    assert early.remaining_estimate(last_run) == timedelta(minutes=2)
    now = datetime(2026, 1, 1, 12, 5, 30, tzinfo=UTC)
    due = cron("*/5 * * * *", tz="UTC", nowfun=fixed_clock(now))
    assert due.is_due(last_run) == (True, 270.0)


def test_oneoff_is_due_once_under_celerys_own_machinery() -> None:
    at = datetime(2026, 6, 1, 12, tzinfo=UTC)
    before = oneoff(at, nowfun=fixed_clock(at - timedelta(minutes=1)))
    assert before.is_due(at - timedelta(hours=1)) == (False, 60.0)
    after = oneoff(at, nowfun=fixed_clock(at + timedelta(seconds=5)))
    due, _ = after.is_due(at - timedelta(hours=1))
    assert due
    assert not after.is_due(at + timedelta(seconds=5))[0]


def test_cron_slots_reuse_one_parser() -> None:
    slots = slots_for("*/5 * * * *", job="five", tz=BERLIN)
    assert isinstance(slots, CronSlots)
    parser = slots._iter
    walk(slots, utc_ms(2026, 3, 28), 50)
    assert slots._iter is parser


# --- properties: every host computes the same slots --------------------------------

ZONES = [
    "UTC",
    "Europe/Berlin",
    "Europe/London",
    "America/Los_Angeles",
    "America/New_York",
    "America/Santiago",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Asia/Kolkata",
]

CRON_EXPRESSIONS = [
    "*/5 * * * *",
    "0 * * * *",
    "30 * * * *",
    "15,45 * * * *",
    "30 1 * * *",
    "30 2 * * *",
    "0 2 * * *",
    "*/10 1-3 * * *",
    "0 0 * * *",
    "59 23 * * *",
    "*/20 0-2 * * 0",
    "0 3 * * 0",
    "0 0 13 * 5",
    "45 1 * 3,4,9,10 0",
    "*/7 2,3 * * *",
]


@functools.cache
def transitions(name: str) -> list[int]:
    """Instants (epoch s) in 2026 at which the zone's UTC offset changes."""
    zone = ZoneInfo(name)
    found = []
    hour = utc_ms(2026, 1, 1) // 1000
    offset = datetime.fromtimestamp(hour, zone).utcoffset()
    for _ in range(366 * 24):
        hour += 3600
        now = datetime.fromtimestamp(hour, zone).utcoffset()
        if now != offset:
            found.append(hour)
        offset = now
    return found or [utc_ms(2026, 6, 1) // 1000]


@st.composite
def zone_and_instant(draw: st.DrawFn) -> tuple[ZoneInfo, int]:
    """A zone and an instant (epoch ms) within two days of one of its transitions."""
    name = draw(st.sampled_from(ZONES))
    near = draw(st.sampled_from(transitions(name)))
    shift = draw(st.integers(-2 * DAY_MS, DAY_MS))
    return ZoneInfo(name), near * 1000 + shift


def reference_slots(
    matches: Callable[[datetime], bool],
    every_hour: bool,
    zone: ZoneInfo,
    after_ms: int,
    end_ms: int,
) -> list[int]:
    """The DST rule by brute force, minute by minute over real instants.

    An instant is a slot when its wall time matches and it is the first pass
    of that wall time (or the hour field is ``*``); the first instant after a
    gap is a slot when any skipped wall time matches.
    """
    found = set()
    minute = after_ms // 60_000 * 60
    previous = datetime.fromtimestamp(minute - 60, zone).utcoffset()
    while minute * 1000 <= end_ms:
        local = datetime.fromtimestamp(minute, zone)
        wall = local.replace(tzinfo=None)
        offset = local.utcoffset()
        assert offset is not None and previous is not None
        if matches(wall) and (local.fold == 0 or every_hour):
            found.add(minute)
        skipped = wall - (offset - previous)
        while skipped < wall:  # wall times of a gap that ends at this instant
            if matches(skipped):
                found.add(minute)
            skipped += timedelta(minutes=1)
        previous = offset
        minute += 60
    return sorted(s * 1000 for s in found if after_ms < s * 1000 <= end_ms)


def cron_matcher(expr: str) -> tuple[Callable[[datetime], bool], bool]:
    """croniter's fields for ``expr`` as a plain predicate (POSIX day rule)."""
    fields = croniter(expr).expanded

    def allowed(index: int, value: int) -> bool:
        return fields[index] == ["*"] or value in fields[index]

    def matches(wall: datetime) -> bool:
        weekday = wall.isoweekday() % 7
        by_month_day, by_weekday = allowed(2, wall.day), allowed(4, weekday)
        restricted = fields[2] != ["*"] and fields[4] != ["*"]
        day = (by_month_day or by_weekday) if restricted else (by_month_day and by_weekday)
        return allowed(0, wall.minute) and allowed(1, wall.hour) and allowed(3, wall.month) and day

    return matches, fields[1] == ["*"]


def crontab_matcher(entry: crontab) -> tuple[Callable[[datetime], bool], bool]:
    """Celery's crontab sets as a plain predicate (both day fields must match)."""

    def matches(wall: datetime) -> bool:
        return (
            wall.minute in entry.minute
            and wall.hour in entry.hour
            and wall.day in entry.day_of_month
            and wall.month in entry.month_of_year
            and wall.isoweekday() % 7 in entry.day_of_week
        )

    return matches, entry.hour == set(range(24))


def assert_increasing(sequence: list[int]) -> None:
    assert all(a < b for a, b in itertools.pairwise(sequence)), "slots must strictly increase"


def assert_agree(slots_a: Slots, slots_b: Slots, start_a: int, start_b: int, count: int) -> None:
    """Two hosts walking from different starts agree wherever they overlap."""
    first, second = sorted([(start_a, slots_a), (start_b, slots_b)], key=lambda pair: pair[0])
    early = walk(first[1], first[0], count)
    late = walk(second[1], second[0], count)
    assert_increasing(early)
    assert_increasing(late)
    overlap = [slot for slot in early if slot > second[0]]
    shared = min(len(overlap), len(late))
    assert overlap[:shared] == late[:shared]


crontabs = st.builds(
    crontab,
    minute=st.sets(st.integers(0, 59), min_size=1, max_size=4),
    hour=st.one_of(st.just("*"), st.sets(st.sampled_from([0, 1, 2, 3, 4, 22, 23]), min_size=1)),
    day_of_week=st.one_of(st.just("*"), st.sets(st.integers(0, 6), min_size=1, max_size=3)),
    day_of_month=st.one_of(st.just("*"), st.sets(st.integers(1, 28), min_size=1, max_size=10)),
)


@settings(max_examples=60, deadline=None)
@given(expr=st.sampled_from(CRON_EXPRESSIONS), where=zone_and_instant())
def test_property_cron_strings_follow_the_dst_rule(expr: str, where: tuple[ZoneInfo, int]) -> None:
    zone, start = where
    slots = slots_for(expr, job="p", tz=zone)
    end = start + DAY_MS + DAY_MS // 2
    matches, every_hour = cron_matcher(expr)
    assert walk_until(slots, start, end) == reference_slots(matches, every_hour, zone, start, end)


@settings(max_examples=60, deadline=None)
@given(entry=crontabs, where=zone_and_instant())
def test_property_crontab_follows_the_dst_rule(entry: crontab, where: tuple[ZoneInfo, int]) -> None:
    zone, start = where
    slots = slots_for(entry, job="p", tz=zone)
    end = start + DAY_MS + DAY_MS // 2
    matches, every_hour = crontab_matcher(entry)
    assert walk_until(slots, start, end) == reference_slots(matches, every_hour, zone, start, end)


@settings(max_examples=60, deadline=None)
@given(
    expr=st.sampled_from([*CRON_EXPRESSIONS, "* * * * * */20", "0 0 1 * *", "0 9 * * 1-5"]),
    where=zone_and_instant(),
    gap=st.integers(0, 2 * DAY_MS),
)
def test_property_hosts_agree_on_cron_slots(
    expr: str, where: tuple[ZoneInfo, int], gap: int
) -> None:
    zone, start = where
    host_a = slots_for(expr, job="p", tz=zone)
    host_b = slots_for(expr, job="p", tz=zone)
    assert_agree(host_a, host_b, start, start + gap, 60)


@settings(max_examples=60, deadline=None)
@given(entry=crontabs, where=zone_and_instant(), gap=st.integers(0, 2 * DAY_MS))
def test_property_hosts_agree_on_crontab_slots(
    entry: crontab, where: tuple[ZoneInfo, int], gap: int
) -> None:
    zone, start = where
    host_a = slots_for(entry, job="p", tz=zone)
    host_b = slots_for(entry, job="p", tz=zone)
    assert_agree(host_a, host_b, start, start + gap, 40)


@settings(max_examples=200, deadline=None)
@given(
    interval_ms=st.integers(1, 30 * DAY_MS),
    anchor_ms=st.integers(-(10**13), 10**13),
    start_a=st.integers(-(10**13), 10**13),
    gap=st.integers(0, 10**9),
)
def test_property_hosts_agree_on_interval_slots(
    interval_ms: int, anchor_ms: int, start_a: int, gap: int
) -> None:
    host_a = slots_for(timedelta(milliseconds=interval_ms), job="p", tz=UTC, anchor_ms=anchor_ms)
    host_b = slots_for(interval_ms / 1000, job="p", tz=UTC, anchor_ms=anchor_ms)
    assert_agree(host_a, host_b, start_a, start_a + gap, 20)
    slot = host_a.next_after(start_a)
    assert slot is not None
    assert (slot - anchor_ms) % interval_ms == 0
    assert start_a < slot <= start_a + interval_ms


# -- one Slots per distinct definition (large schedules) ------------------------------


def test_jobs_of_one_definition_share_one_cron_slots() -> None:
    shared: dict[object, Slots] = {}
    a = slots_for("*/5 * * * *", job="a", tz=UTC, shared=shared)
    b = slots_for("*/5  *  * * *", job="b", tz=UTC, shared=shared)
    berlin = slots_for("*/5 * * * *", job="c", tz=BERLIN, shared=shared)
    tab = slots_for(crontab(minute="*/5"), job="d", tz=UTC, shared=shared)  # day-of AND
    h1 = slots_for("H * * * *", job="h1", tz=UTC, shared=shared)
    h2 = slots_for("H * * * *", job="h2", tz=UTC, shared=shared)
    assert a is b
    assert len({id(s) for s in (a, berlin, tab, h1, h2)}) == 5  # H is hashed from the name
    assert a.next_after(0) == b.next_after(0) == 300_000
    assert a.next_after(0) == 300_000  # the kept answer is the same answer
    assert slots_for("*/5 * * * *", job="e", tz=UTC) is not a  # no sharing unless asked


def test_an_ordinary_cron_is_checked_without_computing_a_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def computed(self: CronSlots, after_ms: int) -> int | None:
        raise AssertionError(f"computed a slot of {self.expr!r}")

    monkeypatch.setattr(CronSlots, "_next_after", computed)
    slots_for("30 3 * * *", job="j", tz=UTC)
    slots_for("0 0 1-28 2 *", job="k", tz=UTC)
    slots_for(crontab(minute=15, hour=4, day_of_week="mon"), job="l", tz=UTC)
    with pytest.raises(AssertionError, match="31 2"):  # only the fields' check can tell
        slots_for("0 0 31 2 *", job="x", tz=UTC)
