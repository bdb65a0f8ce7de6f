"""The portable form of stored jobs: every schedule kind ``beat_schedule``
takes survives JSON with the same slots, and bad definitions are refused
with the job named."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery import schedules

from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.slots import cron, oneoff, slots_for
from celery_anarchon.stored import Definition, Pause, decode_schedule, encode_schedule

UTC = ZoneInfo("UTC")

KINDS = [
    30,
    2.5,
    timedelta(minutes=5),
    schedules.schedule(timedelta(hours=1)),
    "*/5 * * * *",
    "0 9 * * 1-5",
    "* * * * * */2",
    cron("30 2 * * *", tz="Europe/Berlin"),
    schedules.crontab(minute="0", hour="*/3", day_of_week="mon-fri"),
    schedules.crontab(minute=0, hour=0, day_of_month=13, day_of_week=5),
    datetime(2030, 6, 1, 12, 30, tzinfo=ZoneInfo("Europe/Berlin")),
    oneoff(datetime(2031, 1, 1, tzinfo=timezone.utc)),
]


@pytest.mark.parametrize("schedule", KINDS, ids=repr)
def test_every_kind_keeps_its_slots_through_json(schedule: object) -> None:
    stored = json.loads(json.dumps(encode_schedule(schedule, job="j")))
    back = decode_schedule(stored, job="j")
    original = slots_for(schedule, job="j", tz=UTC)
    restored = slots_for(back, job="j", tz=UTC)
    after = int(datetime(2026, 12, 3, tzinfo=timezone.utc).timestamp() * 1000)
    first, second = [], []
    a = b = after
    for _ in range(5):
        a = original.next_after(a) or 0
        b = restored.next_after(b) or 0
        first.append(a)
        second.append(b)
    assert first == second
    assert original.describe() == restored.describe()


def test_a_crontab_keeps_its_own_zone() -> None:
    c = schedules.crontab(minute=0, hour=9)
    c.__dict__["tz"] = ZoneInfo("America/New_York")
    stored = encode_schedule(c, job="j")
    assert stored["tz"] == "America/New_York"
    back = decode_schedule(stored, job="j")
    assert slots_for(back, job="j", tz=UTC).describe() == slots_for(c, job="j", tz=UTC).describe()


def test_solar_round_trips() -> None:
    stored = encode_schedule(schedules.solar("sunrise", 52.5, 13.4), job="j")
    assert stored == {"solar": "sunrise", "lat": 52.5, "lon": 13.4}
    back = decode_schedule(stored, job="j")
    assert (back.event, back.lat, back.lon) == ("sunrise", 52.5, 13.4)


@pytest.mark.parametrize(
    "schedule, message",
    [
        (datetime(2030, 1, 1), "naive"),
        (cron("* * * * *", tz=timezone(timedelta(hours=2))), "IANA"),
        (object(), "unsupported schedule"),
        (float("inf"), "not finite"),
    ],
)
def test_unportable_schedules_are_refused_naming_the_job(schedule: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as caught:
        encode_schedule(schedule, job="nightly")
    assert "stored job 'nightly'" in str(caught.value)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "", "task": "t", "schedule": 5}, "non-empty string"),
        ({"name": "n", "task": "", "schedule": 5}, "task"),
        ({"name": "n", "task": "t", "schedule": 5, "args": "x"}, "expected a list"),
        ({"name": "n", "task": "t", "schedule": 5, "kwargs": [1]}, "expected a dict"),
        ({"name": "n", "task": "t", "schedule": 5, "options": {"qeue": "q"}}, "unknown option"),
        ({"name": "n", "task": "t", "schedule": 5, "args": [{1, 2}]}, "JSON"),
    ],
)
def test_bad_definitions_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Definition.build(**fields)  # type: ignore[arg-type]


def test_a_definition_body_is_one_text_per_definition() -> None:
    one = Definition.build("n", "t", 5, args=(1, "a"), kwargs={"b": 2, "a": 1})
    two = Definition.build("n", "t", 5.0, args=[1, "a"], kwargs={"a": 1, "b": 2})
    assert one.body() == two.body()
    assert Definition.from_body("n", one.body()) == one


def test_a_pause_carries_its_commit_times() -> None:
    paused = Pause.from_record("n", Pause("n", True, "note").body(), version=3, committed_ms=10_000)
    assert (paused.paused, paused.paused_ms, paused.from_ms) == (True, 10_000, 11_000)
    assert paused.covers(11_000) and not paused.covers(10_999)
    resumed_body = Pause("n", False, "note", paused.paused_ms).body()
    resumed = Pause.from_record("n", resumed_body, version=4, committed_ms=20_000)
    assert (resumed.paused_ms, resumed.resumed_ms, resumed.until_ms) == (10_000, 20_000, 21_000)
    assert resumed.covers(20_999) and not resumed.covers(21_000)
