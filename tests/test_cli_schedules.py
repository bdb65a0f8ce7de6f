"""Stored jobs in ``jobs``, ``run-now`` and ``history``, against real
backends (Redis, PostgreSQL, MySQL, SQLite)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from celery_anarchon.cli import EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE
from celery_anarchon.control import Control
from celery_anarchon.schedules import JobExists, Schedules
from celery_anarchon.slots import cron

from .beats import BROKER, read_queue
from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service
from .test_cli import delete_redis_keys, drop_tables, invoke, invoke_json, make_app

#: Every Redis key these tests write starts with this (deleted at the end).
REDIS_PREFIX = f"anarchon-cli-stored:{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module", autouse=True)
def _clean_redis() -> Iterator[None]:
    yield
    delete_redis_keys(REDIS_URL, f"*{REDIS_PREFIX}*")


def backend_for(name: str, tmp_path: Path, run: str) -> str:
    """A backend URL of kind ``name`` with a namespace of its own."""
    return {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=st{run}_",
        "mysql": f"{MYSQL_URL}?prefix=st{run}_",
        "redis": f"{REDIS_URL}?prefix={REDIS_PREFIX}{run}:",
    }[name]


@pytest.fixture
def stored_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Celery]:
    """An app (``tests.test_cli.make_app``: three code entries) on a
    backend of its own, of the kind parametrised indirectly (Redis by
    default)."""
    name = getattr(request, "param", "redis")
    require_service("redis")  # the broker
    require_service(name)
    run = uuid.uuid4().hex[:8]
    url = backend_for(name, tmp_path, run)
    yield make_app(anarchon_backend=url, task_default_queue=f"cli-stored-{run}")
    if name in {"postgresql", "mysql"}:
        drop_tables(url, f"st{run}_")


# -- the Schedules API under the commands ------------------------------------------


@pytest.mark.services
def test_a_refused_add_leaves_the_existing_jobs_pause_alone(stored_app: Celery) -> None:
    """``Schedules.add`` of a taken name wrote the new job's pause state
    before the job itself was refused, pausing (or resuming) the job
    already there."""
    with Schedules(stored_app) as schedules:
        schedules.add("held", "proj.held", 5.0, paused=True, note="keep")
        schedules.add("free", "proj.free", 5.0)
        for name, paused in (("held", False), ("free", True)):
            with pytest.raises(JobExists, match=f"stored job '{name}' exists"):
                schedules.add(name, "proj.other", 9.0, paused=paused)
        assert schedules.get("held").paused and not schedules.get("free").paused
        assert schedules.get("held").pause.note == "keep"  # type: ignore[union-attr]


# -- jobs, run-now, history of stored jobs --------------------------------------------


@pytest.mark.services
@pytest.mark.parametrize("stored_app", ["postgresql", "redis"], indirect=True)
def test_jobs_shows_stored_jobs_with_their_source_pause_and_version(stored_app: Celery) -> None:
    app = stored_app
    with Schedules(app) as schedules:
        first = schedules.add("report", "proj.report", cron("0 7 * * *", tz="Europe/Berlin"))
        schedules.add("held", "proj.held", 90.0, paused=True, note="billing freeze")
        schedules.pause("minutely", note="maintenance")
    report = invoke_json(app, "jobs")
    assert report["stored_jobs"] is True and report["stored_problems"] == {}
    listed = {job["name"]: job for job in report["jobs"]}
    assert list(listed) == ["every-second", "cron-every-2s", "minutely", "held", "report"]
    stored = listed["report"]
    assert stored["source"] == "stored" and stored["version"] == first.version
    assert stored["paused"] is False and stored["pause_note"] is None
    assert stored["schedule"] == "cron '0 7 * * *' (POSIX) Europe/Berlin"
    assert stored["zone"] == "Europe/Berlin" and stored["last_state"] is None
    assert stored["next"][0]["local"].endswith(":00 CET") and stored["task"] == "proj.report"
    assert [slot["slot_ms"] >= first.effective_ms for slot in stored["next"]] == [True] * 3
    held = listed["held"]
    assert held["source"] == "stored" and held["paused"] is True
    assert held["pause_note"] == "billing freeze"
    code = listed["minutely"]
    assert code["source"] == "code" and code["version"] == 0
    assert code["paused"] is True and code["pause_note"] == "maintenance"
    assert listed["every-second"]["paused"] is False
    text = invoke(app, "jobs").stdout
    assert "5 job(s), 2 stored" in text
    table = [line.split() for line in text.splitlines() if line[:1].strip() and " " in line]
    rows = {cells[0]: cells for cells in table}
    assert rows["JOB"] == ["JOB", "SOURCE", "PAUSED", "NEXT", "(UTC)", "LAST", "SCHEDULE", "ZONE"]
    assert rows["held"][1:5] == ["stored", "yes:", "billing", "freeze"]
    assert rows["minutely"][1:3] == ["code", "yes:"] and rows["report"][1:3] == ["stored", "-"]
    assert rows["report"][-1] == "Europe/Berlin"
    assert "  source    stored, version " in text
    assert "  paused    yes: billing freeze (no slot is sent until `resume`)" in text


@pytest.mark.services
@pytest.mark.parametrize("stored_app", ["postgresql", "redis"], indirect=True)
def test_run_now_of_a_stored_job_sends_one_message_to_its_queue(stored_app: Celery) -> None:
    app = stored_app
    queue = f"stored-{uuid.uuid4().hex[:8]}"
    with Schedules(app) as schedules:
        schedules.add("report", "itest.noop", 3600.0, options={"queue": queue})
    try:
        first = invoke_json(app, "run-now", "report", "--key", "ticket-7")
        assert first["sent"] is True and first["job"] == "report"
        again = invoke(app, "run-now", "report", "--key", "ticket-7")
        assert again.exit_code == EXIT_PROBLEM and "was used before" in again.stdout
        sent = read_queue(BROKER, queue, timeout=1.0)
        assert [h["anarchon_job"] for h in sent] == ["report"]
        assert sent[0]["id"] == first["task_id"]
        history = invoke_json(app, "history", "report")
        assert history["source"] == "stored" and history["in_beat_schedule"] is False
        [record] = history["records"]
        assert record["state"] == "sent" and record["manual_key"] == "ticket-7"
        assert record["task_id"] == first["task_id"]
        assert invoke_json(app, "last-run", "report")["run"]["task_id"] == first["task_id"]
        listed = {job["name"]: job for job in invoke_json(app, "jobs")["jobs"]}
        assert listed["report"]["last_state"] == "sent"
        assert listed["report"]["last_slot_ms"] == record["slot_ms"]
        assert listed["minutely"]["last_state"] is None
        # Removed, its history stays and says so; it can no longer be run.
        with Schedules(app) as schedules:
            schedules.remove("report")
        table = invoke(app, "history", "report").stdout
        assert "report (no longer in beat_schedule nor stored): 1 run(s)" in table
        gone = invoke(app, "run-now", "report")
        assert gone.exit_code == EXIT_USAGE and "nor among the stored jobs" in gone.stderr
    finally:
        delete_redis_keys(BROKER, queue)


@pytest.mark.services
def test_a_code_entry_wins_over_a_stored_job_of_the_same_name(stored_app: Celery) -> None:
    """A stored job added where the name was free, then read by an app whose
    code has an entry of that name (a deploy that added it): the code entry
    is the job, as on a beat that has both."""
    with Schedules(stored_app) as schedules:
        schedules.add("shared", "stored.task", 5.0)
    code_app = make_app(
        anarchon_backend=stored_app.conf.anarchon_backend,
        beat_schedule={"shared": {"task": "code.task", "schedule": 60.0}},
    )
    shared = {job["name"]: job for job in invoke_json(code_app, "jobs")["jobs"]}["shared"]
    assert shared["source"] == "code" and shared["task"] == "code.task"
    with Control(code_app) as control:
        assert control.job("shared").entry.task == "code.task"
    with Control(stored_app) as control:
        assert control.job("shared").entry.task == "stored.task"
        assert control.job("shared").source == "stored"


def test_jobs_lists_code_entries_and_exits_3_when_the_backend_is_down() -> None:
    app = make_app(anarchon_backend="redis://:s3cret@127.0.0.1:1/0")
    result = invoke(app, "jobs")
    assert result.exit_code == EXIT_UNREACHABLE
    assert "every-second" in result.stdout and "minutely" in result.stdout
    assert "claim backend unreachable" in result.stderr and "s3cret" not in result.output
    report = invoke_json(app, "jobs", code=EXIT_UNREACHABLE)
    assert report["exit_code"] == EXIT_UNREACHABLE and "unreachable" in report["error"]
    assert {job["source"] for job in report["jobs"]} == {"code"}


@pytest.mark.services
def test_jobs_on_a_claim_only_backend_lists_the_code_entries(rabbit_vhost: str) -> None:
    app = make_app(anarchon_backend=f"amqp://guest:guest@127.0.0.1:5672/{rabbit_vhost}")
    report = invoke_json(app, "jobs")
    assert report["stored_jobs"] is False and report["supports_leases"] is False
    assert {job["source"] for job in report["jobs"]} == {"code"}
    assert {job["last_state"] for job in report["jobs"]} == {None}
