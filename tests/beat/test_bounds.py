"""Start and end bounds and run limits, on code entries and stored jobs: no
slot outside the bounds, exactly ``max_runs`` runs, the job finished with
its reason recorded once, and bad bounds refused at start-up."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_anarchon.backends.base import State
from celery_anarchon.beat.scheduler import Scheduler
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.schedules import Schedules
from celery_anarchon.settings import Settings

from .support import make_app, sent_slots


def run_for(s: Scheduler, seconds: float) -> None:
    until = time.time() + seconds
    while time.time() < until:
        time.sleep(max(min(s.tick(), 0.05), 0.0))
    s.tick()


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def of(app: Celery, job: str) -> list[int]:
    return sorted(slot for name, slot in sent_slots(app) if name == job)


def test_max_runs_sends_exactly_that_many_then_records_finished_once(lease_url: str) -> None:
    schedule = {"thrice": {"task": "t.noop", "schedule": 0.5, "anarchon": {"max_runs": 3}}}
    app = make_app(lease_url, schedule)
    s = Scheduler(app)
    try:
        run_for(s, 3.5)
        assert len(of(app, "thrice")) == 3
        assert s.jobs["thrice"].finished == "max_runs=3 reached"
        history = s.backend.history("thrice")  # type: ignore[union-attr]
        finished = [r for r in history if r.state == State.SKIPPED]
        assert len(finished) == 1 and "max_runs=3 reached" in (finished[0].error or "")
    finally:
        s.close()
    # A restart finds the limit reached and claims nothing.
    again = Scheduler(app)
    try:
        run_for(again, 1.5)
        assert of(app, "thrice") == []
        assert again.jobs["thrice"].finished
    finally:
        again.close()


def test_start_and_end_bounds_keep_slots_inside(lease_url: str) -> None:
    now = time.time()
    start, end = int(now) + 2, int(now) + 4
    bounds = {"start_at": iso(start), "end_at": datetime.fromtimestamp(end, timezone.utc)}
    app = make_app(lease_url, {"bounded": {"task": "t.noop", "schedule": 1.0, "anarchon": bounds}})
    s = Scheduler(app)
    try:
        run_for(s, end - time.time() + 1.5)
        assert of(app, "bounded") == [start * 1000, (start + 1) * 1000, end * 1000]
        assert s.jobs["bounded"].finished.startswith("end_at")
        records = {r.slot_ms: r for r in s.backend.history("bounded")}  # type: ignore[union-attr]
        assert records[end * 1000].state == State.SENT  # the last slot was a real run
    finally:
        s.close()


def test_a_stored_job_with_a_run_limit_is_revived_by_raising_it(lease_url: str) -> None:
    app = make_app(lease_url, {})
    with Schedules(app) as schedules:
        schedules.add("twice", "t.noop", 0.5, max_runs=2)
        s = Scheduler(app)
        try:
            run_for(s, 3.0)
            assert len(of(app, "twice")) == 2
            schedules.update("twice", max_runs=3)
            run_for(s, 2.5)
            assert len(of(app, "twice")) == 1
            assert schedules.get("twice").definition.anarchon["max_runs"] == 3  # type: ignore[union-attr]
        finally:
            s.close()


@pytest.mark.parametrize(
    "bounds, message",
    [
        ({"start_at": "2027-01-02T00:00:00Z", "end_at": "2027-01-01T00:00:00Z"}, "before start_at"),
        ({"max_runs": 0}, "max_runs must be a whole number >= 1"),
        ({"max_runs": -2}, "max_runs must be a whole number >= 1"),
        ({"start_at": datetime(2027, 1, 1)}, "naive"),
        ({"end_at": "2027-01-01T00:00:00"}, "naive"),
        ({"end_at": "next tuesday"}, "ISO 8601"),
    ],
)
def test_bad_bounds_are_refused_naming_the_job(bounds: dict[str, object], message: str) -> None:
    app = Celery("bounds", set_as_current=False)
    with pytest.raises(ConfigurationError, match=message) as caught:
        Settings.from_app(app).job_options("nightly", bounds)
    assert "nightly" in str(caught.value)


def test_the_api_refuses_bad_bounds_and_writes_nothing(lease_url: str) -> None:
    app = make_app(lease_url, {})
    with Schedules(app) as schedules:
        later = datetime.now(timezone.utc) + timedelta(days=2)
        with pytest.raises(ConfigurationError, match="before start_at"):
            schedules.add("x", "t.noop", 60, start_at=later, end_at=later - timedelta(days=1))
        with pytest.raises(ConfigurationError, match=">= 1"):
            schedules.add("x", "t.noop", 60, max_runs=0)
        assert schedules.state().version == 0


def test_a_run_limit_needs_a_lease_backend() -> None:
    """RabbitMQ keeps no count of runs: a job with max_runs is refused there."""
    from celery_anarchon.backends import backend_from_url
    from celery_anarchon.checks import check_backend_supports
    from celery_anarchon.model import Entry, build_jobs

    app = Celery("limits", set_as_current=False)
    settings = Settings.from_app(app)
    entry = Entry(name="n", task="t", schedule=60, anarchon={"max_runs": 2}, app=app)
    job = build_jobs({"n": entry}, settings, timezone.utc)["n"]  # type: ignore[arg-type]
    backend = backend_from_url("amqp://guest:guest@127.0.0.1:5672//", instance="i")
    with pytest.raises(ConfigurationError, match="max_runs .* need a lease backend"):
        check_backend_supports(backend, settings, job)
