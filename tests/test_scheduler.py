"""The Scheduler in one process: a fixed clock, a real SQLite backend and
kombu's in-process ``memory://`` transport as the Celery broker."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_anarchon.backends.base import State
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.message import task_id_for


class Clock:
    """A clock the test moves by hand (seconds since the epoch)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_app(tmp_path: Path, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery(f"sched-{uuid.uuid4().hex[:6]}", set_as_current=False)
    settings: dict[str, Any] = {
        "broker_url": "memory://",
        "task_default_queue": f"q-{uuid.uuid4().hex[:8]}",
        "anarchon_backend": f"sqlite:///{tmp_path / 'claims.db'}",
        "anarchon_jitter": 0,
        "anarchon_max_skew": 120,  # the test clock runs up to 80 s ahead
        "beat_schedule": schedule,
        "timezone": "UTC",
    }
    app.conf.update({**settings, **conf})
    return app


def sent_messages(app: Celery) -> list[dict[str, Any]]:
    """Take every message off the app's default queue; their headers."""
    out = []
    with Connection("memory://") as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        while True:
            try:
                message = queue.get(timeout=0.05)
            except queue.Empty:
                break
            out.append(dict(message.headers))
            message.ack()
        queue.close()
    return out


@pytest.fixture
def t0() -> float:
    """A whole second 10 s past the real now (a loaded machine may take
    seconds to set a test up, and the backend refuses slots older than its
    own now minus max_late).

    The SQLite backend judges the claim window by the process clock, so the
    test clock starts at the real time and moves forward by hand from there
    (``anarchon_max_skew`` is widened to let it run ahead).
    """
    return float(int(time.time()) + 10)


@pytest.fixture
def every_second() -> dict[str, Any]:
    return {"tick": {"task": "proj.tick", "schedule": 1.0, "args": (1, 2)}}


def test_sends_each_due_slot_with_headers_and_derived_task_id(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = make_app(tmp_path, every_second, anarchon_max_late=0.5)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        assert s.tick() == pytest.approx(0.5)  # first slot: t0 + 1
        assert sent_messages(app) == []
        clock.now = t0 + 1.0
        s.tick()
        [headers] = sent_messages(app)
        slot = int((t0 + 1) * 1000)
        assert headers["anarchon_job"] == "tick"
        assert headers["anarchon_slot"] == slot
        assert headers["anarchon_token"] == 1
        assert headers["id"] == task_id_for("tick", slot)
        assert headers["task"] == "proj.tick"
        [record] = s.backend.history("tick")  # type: ignore[union-attr]
        assert (record.state, record.task_id) == (State.SENT, task_id_for("tick", slot))
    finally:
        s.close()


def test_two_schedulers_on_one_backend_send_each_slot_once(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = make_app(tmp_path, every_second, anarchon_max_late=0.5)
    clock = Clock(t0 + 0.5)
    a, b = Scheduler(app, clock=clock), Scheduler(app, clock=clock)
    try:
        for step in range(1, 11):
            clock.now = t0 + step
            (a, b)[step % 2].tick()
            (b, a)[step % 2].tick()
        sent = sent_messages(app)
        slots = [h["anarchon_slot"] for h in sent]
        assert sorted(slots) == [int((t0 + i) * 1000) for i in range(1, 11)]
        senders = {r.instance for r in a.backend.history("tick")}  # type: ignore[union-attr]
        assert senders == {a.instance_id, b.instance_id}
    finally:
        a.close()
        b.close()


def test_a_slot_later_than_max_late_is_recorded_missed_not_sent(
    t0: float, tmp_path: Path, every_second: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path, every_second, anarchon_max_late=2)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        clock.now = t0 + 10.5  # slots t0-1 .. t0+8 are more than 2 s late
        with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
            s.tick()
        sent = sorted(h["anarchon_slot"] for h in sent_messages(app))
        assert sent == [int((t0 + i) * 1000) for i in (9, 10)]
        history = s.backend.history("tick")  # type: ignore[union-attr]
        missed = sorted(r.slot_ms for r in history if r.state is State.MISSED)
        assert missed == [int((t0 + i) * 1000) for i in range(-1, 9)]
        assert "missed 10 slot(s) of tick" in caplog.text
    finally:
        s.close()


def test_start_up_never_records_old_slots_as_missed(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    app = make_app(tmp_path, every_second, anarchon_max_late=3)
    clock = Clock(t0 + 0.5)
    s = Scheduler(app, clock=clock)
    try:
        s.tick()
        history = s.backend.history("tick")  # type: ignore[union-attr]
        assert {r.state for r in history} == {State.SENT}
        # The slots inside max_late before start-up are sent, nothing older.
        assert sorted(r.slot_ms for r in history) == [int((t0 + i) * 1000) for i in (-2, -1, 0)]
    finally:
        s.close()


def test_jitter_delays_the_claim_inside_the_heap(t0: float, tmp_path: Path) -> None:
    schedule = {"j": {"task": "proj.j", "schedule": 60.0, "anarchon": {"jitter": 5}}}
    app = make_app(tmp_path, schedule, anarchon_max_late=10)
    slot = (int(t0) // 60 + 1) * 60  # the next whole minute
    clock = Clock(slot - 1.0)
    s = Scheduler(app, clock=clock)
    try:
        clock.now = slot
        wait = s.tick()
        assert 0 <= wait <= 5
        clock.now = slot + 5
        s.tick()
        assert [h["anarchon_slot"] for h in sent_messages(app)] == [slot * 1000]
    finally:
        s.close()


def test_jitter_must_stay_below_max_late(tmp_path: Path) -> None:
    schedule = {"j": {"task": "proj.j", "schedule": 60.0, "anarchon": {"jitter": 5}}}
    with pytest.raises(ConfigurationError, match="'j'.*jitter.*max_late"):
        Scheduler(make_app(tmp_path, schedule, anarchon_max_late=5))


def test_lazy_construction_connects_nothing(every_second: dict[str, Any], tmp_path: Path) -> None:
    app = make_app(tmp_path, every_second, anarchon_backend="redis://127.0.0.1:1/0")
    s = Scheduler(app, lazy=True)
    assert s.backend is None
    assert "anarchon" in s.info
    s.close()
    s.close()


def test_an_unreachable_backend_keeps_beat_alive_and_sends_nothing(
    t0: float, tmp_path: Path, every_second: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path, every_second, anarchon_backend="redis://127.0.0.1:1/0")
    clock = Clock(t0 + 0.5)
    with caplog.at_level(logging.WARNING, logger="celery_anarchon.beat"):
        s = Scheduler(app, clock=clock)
        for step in range(1, 6):
            clock.now = t0 + step
            assert s.tick() >= 0
    assert sent_messages(app) == []
    outages = [r for r in caplog.records if "is unavailable" in r.getMessage()]
    assert [r.levelname for r in outages] == ["WARNING"]  # once per outage, not per slot
    s.close()
    s.close()


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        ("0 0 31 2 *", ["'bad'", "schedule"]),
        ("every day", ["'bad'", "schedule"]),
        (0, ["'bad'"]),
        (-5.0, ["'bad'"]),
    ],
)
def test_bad_schedules_are_refused_at_start_up(
    tmp_path: Path, schedule: object, words: list[str]
) -> None:
    app = make_app(tmp_path, {"bad": {"task": "proj.bad", "schedule": schedule}})
    with pytest.raises(ConfigurationError) as err:
        Scheduler(app)
    for word in words:
        assert word in str(err.value)


def test_unknown_per_entry_key_is_refused(tmp_path: Path) -> None:
    schedule = {"sync": {"task": "proj.sync", "schedule": 5.0, "anarchon": {"jiter": 0}}}
    with pytest.raises(ConfigurationError, match="'sync'.*jiter"):
        Scheduler(make_app(tmp_path, schedule))


def test_apply_entry_never_raises(t0: float, tmp_path: Path, every_second: dict[str, Any]) -> None:
    s = Scheduler(make_app(tmp_path, every_second), clock=Clock(t0))
    try:
        s.apply_entry(s.schedule["tick"], producer=None)
    finally:
        s.close()


def test_a_job_more_frequent_than_the_jitter_never_falls_behind(
    t0: float, tmp_path: Path, every_second: dict[str, Any]
) -> None:
    # Claim delays up to 5 s on a one-second job: each slot's claim waits in
    # the heap while the job's next slots keep falling due on time.
    app = make_app(tmp_path, every_second, anarchon_jitter=5, anarchon_max_late=10)
    clock = Clock(t0 - 10)
    s = Scheduler(app, clock=clock)
    try:
        for step in range(0, 7):
            clock.now = t0 + step
            s.tick()
            assert s.jobs["tick"].next_slot_ms == int((t0 + step + 1) * 1000)
        clock.now = t0 + 12
        s.tick()
        sent = sorted(h["anarchon_slot"] for h in sent_messages(app))
        window = [x for x in sent if t0 * 1000 <= x < (t0 + 7) * 1000]
        assert window == [int((t0 + i) * 1000) for i in range(7)]  # every one, none missed
    finally:
        s.close()


def test_start_up_names_every_bad_entry_at_once(tmp_path: Path) -> None:
    schedule = {
        "typo": {"task": "t", "schedul": 5.0},
        "hour25": {"task": "t", "schedule": "*/15 25 * * *"},
        "jiter": {"task": "t", "schedule": 5.0, "anarchon": {"jiter": 1}},
    }
    with pytest.raises(ConfigurationError) as err:
        Scheduler(make_app(tmp_path, schedule))
    message = str(err.value)
    assert "3 configuration problem(s)" in message
    for words in ("'typo'", "Did you mean 'schedule'", "'hour25'", "hour 0-23", "'jiter'"):
        assert words in message


def test_a_missing_database_driver_names_the_extra(
    tmp_path: Path, every_second: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver is installed here, so hide it: the one failure a real
    # install cannot show on this machine.
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a)
    )
    app = make_app(tmp_path, every_second, anarchon_backend="postgresql://db/proj")
    with pytest.raises(ConfigurationError, match=r"psycopg.*celery-anarchon\[postgres\]"):
        Scheduler(app)


def test_a_schedule_of_the_wrong_type_names_the_job(tmp_path: Path) -> None:
    schedule = {"listed": {"task": "t", "schedule": [5]}}
    with pytest.raises(ConfigurationError, match=r"'listed'.*\[5\] is not a schedule"):
        Scheduler(make_app(tmp_path, schedule))
