"""``celery anarchon add|update|remove|pause|resume`` and the stored jobs in
``jobs``, ``run-now`` and ``history``, against real backends (Redis,
PostgreSQL, MySQL, SQLite) and one real ``celery beat``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_anarchon.cli import EXIT_CONFIG, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE
from celery_anarchon.control import Control
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.schedules import JobExists, Schedules
from celery_anarchon.slots import cron

from .beats import BROKER, BeatCluster, read_queue
from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service
from .test_cli import (
    cli,
    cluster_app,
    delete_redis_keys,
    drop_tables,
    invoke,
    invoke_json,
    make_app,
)

#: Every Redis key these tests write starts with this (deleted at the end).
REDIS_PREFIX = f"anarchon-cli-stored:{uuid.uuid4().hex[:8]}:"

LEASE_BACKENDS = ["sqlite", "postgresql", "mysql", "redis"]

#: What the refusal on a claim-only backend names.
LEASE_BACKENDS_NAMED = "set anarchon_backend to a shared Redis, PostgreSQL or MySQL URL"


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


def jobs_of(app: Celery) -> dict[str, dict[str, Any]]:
    return {job["name"]: job for job in invoke_json(app, "jobs")["jobs"]}


def fails(app: Celery, *args: str, code: int = EXIT_USAGE) -> str:
    """Run a command that must fail with ``code``: its one-line message (the
    same in --json)."""
    result = invoke(app, *args)
    assert result.exit_code == code, result.output
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.output
    error = invoke_json(app, *args, code=code)
    assert error == {"error": error["error"], "exit_code": code}
    assert error["error"] in result.stderr
    return error["error"]


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


# -- the life of a stored job, on each lease backend -----------------------------


@pytest.mark.services
@pytest.mark.parametrize("stored_app", LEASE_BACKENDS, indirect=True)
def test_add_pause_update_resume_remove(stored_app: Celery) -> None:
    app = stored_app
    before = int(time.time() * 1000)
    added = invoke_json(
        app,
        "add",
        "report",
        "--task",
        "proj.report",
        "--cron",
        "*/5 * * * *",
        "--tz",
        "Europe/Berlin",
        "--kwargs",
        '{"size": 3}',
        "--queue",
        "reports",
    )
    assert set(added) == {
        "job",
        "action",
        "source",
        "version",
        "committed_ms",
        "effective_ms",
        "schedule",
        "next_slot_ms",
        "next_slot",
        "definition",
        "paused",
        "pause_note",
    }
    assert added["job"] == "report" and added["action"] == "added" and added["version"] >= 1
    assert added["effective_ms"] == added["committed_ms"] + 1000
    assert added["schedule"] == "cron '*/5 * * * *' Europe/Berlin"
    assert added["definition"]["schedule"] == {"cron": "*/5 * * * *", "tz": "Europe/Berlin"}
    assert added["definition"]["kwargs"] == {"size": 3}
    assert added["definition"]["options"] == {"queue": "reports"}
    assert added["next_slot_ms"] > before and added["next_slot_ms"] % 300_000 == 0
    assert added["paused"] is False and added["pause_note"] is None

    listed = jobs_of(app)
    assert set(listed) == {"every-second", "cron-every-2s", "minutely", "report"}
    report = listed["report"]
    assert report["source"] == "stored" and report["version"] == added["version"]
    assert report["paused"] is False and report["pause_note"] is None
    assert report["zone"] == "Europe/Berlin" and report["last_state"] is None
    assert report["next"][0]["slot_ms"] == added["next_slot_ms"]
    assert report["schedule"] == "cron '*/5 * * * *' (POSIX) Europe/Berlin"
    assert listed["minutely"]["source"] == "code" and listed["minutely"]["version"] == 0

    paused = invoke_json(app, "pause", "report", "--note", "billing freeze")
    assert paused["paused"] is True and paused["changed"] is True
    assert paused["note"] == "billing freeze" and paused["version"] > added["version"]
    report = jobs_of(app)["report"]
    assert report["paused"] is True and report["pause_note"] == "billing freeze"

    updated = invoke_json(app, "update", "report", "--every", "2m")
    assert updated["action"] == "updated" and updated["version"] > paused["version"]
    assert updated["definition"]["schedule"] == {"every": 120.0}
    assert updated["definition"]["kwargs"] == {"size": 3}  # what was not given stays
    assert updated["definition"]["options"] == {"queue": "reports"}
    assert updated["paused"] is True  # an update keeps the pause

    resumed = invoke_json(app, "resume", "report")
    assert resumed["paused"] is False and resumed["changed"] is True
    report = jobs_of(app)["report"]
    assert report["paused"] is False and report["schedule"].startswith("every 120s")
    assert report["version"] == updated["version"]

    removed = invoke_json(app, "remove", "report")
    assert removed == {"job": "report", "action": "removed", "version": removed["version"]}
    assert removed["version"] > resumed["version"]
    assert "report" not in jobs_of(app)
    assert "no stored job or code entry has that name" in fails(app, "remove", "report")


@pytest.mark.services
def test_the_commands_print_what_they_did(stored_app: Celery) -> None:
    app = stored_app
    added = invoke(app, "add", "sync", "--task", "proj.sync", "--every", "30s", "--args", "[1]")
    assert added.exit_code == EXIT_OK, added.output
    lines = added.stdout.splitlines()
    assert lines[0].startswith("sync: added (version ") and "every 30s, task proj.sync" in lines[0]
    assert lines[1].startswith("  next slot  ") and lines[1].endswith("Z")
    assert "  args       [1]" in lines
    paused = invoke(app, "pause", "sync", "--note", "freeze")
    assert paused.exit_code == EXIT_OK and paused.stdout.startswith("sync: paused (freeze)")
    again = invoke(app, "pause", "sync", "--note", "other")
    assert again.exit_code == EXIT_OK and "sync: already paused since" in again.stdout
    assert "(freeze)" in again.stdout  # the first note stays
    table = invoke(app, "jobs").stdout
    [row] = [line for line in table.splitlines() if line.startswith("sync ")]
    assert row.split()[:4] == ["sync", "stored", "yes:", "freeze"]
    assert "  source    stored, version " in table
    assert "  paused    yes: freeze (no slot is sent until `resume`)" in table
    assert "4 job(s), 1 stored" in table
    resumed = invoke(app, "resume", "sync")
    assert resumed.exit_code == EXIT_OK and resumed.stdout.startswith("sync: resumed, version")
    idle = invoke(app, "resume", "sync")
    assert idle.exit_code == EXIT_OK and "sync: not paused; nothing to resume" in idle.stdout
    removed = invoke(app, "remove", "sync")
    assert removed.exit_code == EXIT_OK and "its history stays" in removed.stdout


@pytest.mark.services
def test_pause_and_resume_of_a_code_entry(stored_app: Celery) -> None:
    app = stored_app
    paused = invoke_json(app, "pause", "minutely", "--note", "maintenance")
    assert paused["changed"] is True and paused["paused"] is True
    minutely = jobs_of(app)["minutely"]
    assert minutely["source"] == "code" and minutely["paused"] is True
    assert minutely["pause_note"] == "maintenance"
    again = invoke_json(app, "pause", "minutely")
    assert again["changed"] is False and again["version"] == paused["version"]
    assert invoke_json(app, "resume", "minutely")["changed"] is True
    assert jobs_of(app)["minutely"]["paused"] is False
    idle = invoke_json(app, "resume", "minutely")
    assert idle["changed"] is False and idle["paused"] is False


@pytest.mark.services
def test_add_paused_with_a_note_and_a_one_off_instant(stored_app: Celery) -> None:
    added = invoke_json(
        stored_app,
        "add",
        "launch",
        "--task",
        "itest.noop",
        "--at",
        "2027-01-01T01:00+01:00",
        "--paused",
        "--note",
        "waits for review",
    )
    assert added["definition"]["schedule"] == {"at": "2027-01-01T00:00:00.000Z"}
    assert added["next_slot"] == "2027-01-01T00:00:00Z"
    assert added["paused"] is True and added["pause_note"] == "waits for review"
    launch = jobs_of(stored_app)["launch"]
    assert launch["paused"] is True and launch["pause_note"] == "waits for review"
    assert [slot["utc"] for slot in launch["next"]] == ["2027-01-01T00:00:00Z"]


# -- what is refused -------------------------------------------------------------------

ADD = ["add", "fresh", "--task", "itest.noop"]

BAD_ADDS = [
    ("impossible-cron", ["--cron", "61 * * * *"], "cannot read cron '61 * * * *'"),
    ("never-matching-cron", ["--cron", "0 0 31 2 *"], "never matches"),
    ("unknown-zone", ["--cron", "0 7 * * *", "--tz", "Mars/Olympus"], "'Mars/Olympus'"),
    ("naive-at", ["--at", "2027-01-01T00:00"], "--at '2027-01-01T00:00' has no time zone"),
    (
        "naive-date",
        ["--at", "2027-01-01"],
        "e.g. 2027-01-01T00:00Z (UTC) or 2027-01-01T00:00+01:00",
    ),
    ("naive-at-9", ["--at", "2027-01-01T09:00"], "e.g. 2027-01-01T09:00Z (UTC) or 2027-01"),
    ("naive-fraction", ["--at", "2027-01-01T05:07:00.5"], "e.g. 2027-01-01T05:07:00.500000Z"),
    ("not-iso-at", ["--at", "next tuesday"], "is not ISO 8601"),
    ("past-at", ["--at", "2020-01-01T00:00Z"], "has no slot after the change holds"),
    ("bad-duration", ["--every", "5x"], "--every '5x': give seconds or a duration"),
    ("zero-interval", ["--every", "0"], "below the floor of 0.1 s"),
    ("args-not-json", ["--every", "5", "--args", "[1,"], "--args: '[1,' is not JSON"),
    ("args-not-a-list", ["--every", "5", "--args", '{"a": 1}'], "--args: expected a JSON list"),
    ("kwargs-not-an-object", ["--every", "5", "--kwargs", "[1]"], "expected a JSON object"),
    ("args-the-task-refuses", ["--every", "5", "--args", "[1]"], "does not take its args"),
    ("two-schedules", ["--every", "5", "--cron", "* * * * *"], "give one schedule, not --every"),
    ("tz-without-cron", ["--every", "5", "--tz", "UTC"], "--tz is the zone of a --cron"),
    ("no-schedule", [], "give a schedule, --every, --cron or --at"),
    ("note-without-paused", ["--every", "5", "--note", "x"], "give it with --paused"),
]


@pytest.mark.services
@pytest.mark.parametrize(
    ("extra", "message"), [b[1:] for b in BAD_ADDS], ids=[b[0] for b in BAD_ADDS]
)
def test_a_bad_definition_is_refused_with_exit_2_and_writes_nothing(
    stored_app: Celery, extra: list[str], message: str
) -> None:
    assert message in fails(stored_app, *ADD, *extra)
    assert "fresh" not in jobs_of(stored_app)


@pytest.mark.services
def test_add_needs_a_task(stored_app: Celery) -> None:
    assert "give the task, --task" in fails(stored_app, "add", "fresh", "--every", "5")


@pytest.mark.services
def test_names_that_are_taken_or_unknown_are_refused(stored_app: Celery) -> None:
    app = stored_app
    code = fails(app, "add", "minutely", "--task", "itest.noop", "--every", "5")
    assert "'minutely' is a beat_schedule entry" in code
    assert "stored" not in {job["source"] for job in jobs_of(app).values()}
    for command in ("update", "remove"):
        extra = ["--every", "5"] if command == "update" else []
        message = fails(app, command, "minutely", *extra)
        assert "code entries change in the code" in message
    for command in ("update", "remove", "pause", "resume"):
        extra = ["--every", "5"] if command == "update" else []
        message = fails(app, command, "no-such-job", *extra)
        assert "no stored job or code entry has that name" in message, command
    invoke_json(app, "add", "once", "--task", "itest.noop", "--every", "5")
    assert "stored job 'once' exists" in fails(
        app, "add", "once", "--task", "itest.noop", "--every", "9"
    )
    assert jobs_of(app)["once"]["schedule"].startswith("every 5s")  # unchanged
    assert "nothing to change" in fails(app, "update", "once")
    assert "cannot read cron" in fails(app, "update", "once", "--cron", "61 * * * *")
    assert jobs_of(app)["once"]["schedule"].startswith("every 5s")  # the old one stays


def test_a_claim_only_backend_refuses_every_command_naming_the_lease_backends() -> None:
    """RabbitMQ keeps no stored jobs; the refusal is exit 2 and connects to
    nothing (nothing listens on port 1)."""
    app = make_app(anarchon_backend="amqp://guest:s3cret@127.0.0.1:1//")
    for args in (
        [*ADD, "--every", "5"],
        ["update", "minutely", "--every", "5"],
        ["remove", "minutely"],
        ["pause", "minutely"],
        ["resume", "minutely"],
    ):
        message = fails(app, *args)
        assert "is claim-only and keeps no stored jobs" in message
        assert LEASE_BACKENDS_NAMED in message and "s3cret" not in message


def test_an_unreachable_backend_exits_3_and_a_broken_configuration_4() -> None:
    down = make_app(anarchon_backend="redis://:s3cret@127.0.0.1:1/0")
    for args in ([*ADD, "--every", "5"], ["remove", "x"], ["pause", "x"], ["resume", "x"]):
        message = fails(down, *args, code=EXIT_UNREACHABLE)
        assert "claim backend unreachable" in message and "s3cret" not in message
    broken = make_app(anarchon_backend="redis://127.0.0.1:1/0", anarchon_jitter=99)
    message = fails(broken, *ADD, "--every", "5", code=EXIT_CONFIG)
    assert "anarchon_jitter" in message


def test_update_and_remove_never_create_the_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "claims.db"
    app = make_app(anarchon_backend=f"sqlite:///{path}")
    for args in (["update", "x", "--every", "5"], ["remove", "x"]):
        assert "does not exist" in fails(app, *args, code=EXIT_UNREACHABLE)
    assert not path.exists()
    assert invoke_json(app, *ADD, "--every", "5")["action"] == "added"  # add creates it
    assert path.exists() and jobs_of(app)["fresh"]["source"] == "stored"


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


def test_the_group_lists_the_commands() -> None:
    text = invoke(make_app(), "--help").stdout
    for command in ("add", "update", "remove", "pause", "resume", "jobs", "run-now"):
        assert f"  {command} " in text, command


# -- a stored job on a running beat ----------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
def test_a_job_added_from_the_command_line_runs_on_a_beat(tmp_path: Path) -> None:
    """Through the real entry point: a beat that is already running sends a
    job added with ``add``; ``history`` shows its runs and ``jobs`` their
    last state; after ``pause`` its history records the pause."""
    require_service("redis")
    beats = BeatCluster(f"{REDIS_URL}?prefix={REDIS_PREFIX}beat:", tmp_path)
    beats.start(1)
    app = cluster_app(beats)
    try:
        assert beats.wait_ticking(), beats.logs()
        done = cli(beats, "add", "live", "--task", "itest.noop", "--every", "1s", "--json")
        assert done.returncode == EXIT_OK, done.stdout + done.stderr
        assert json.loads(done.stdout)["job"] == "live"
        deadline = time.monotonic() + 30
        while len(sent_records(app, "live")) < 2:
            assert time.monotonic() < deadline, beats.logs()
            time.sleep(0.5)
        history = invoke_json(app, "history", "live")
        assert history["source"] == "stored"
        assert all(
            r["instance"].split(":")[1] == str(beats.procs[0].pid) for r in history["records"]
        )
        assert jobs_of(app)["live"]["last_state"] in {"claimed", "sent"}
        paused = cli(beats, "pause", "live", "--note", "enough")
        assert paused.returncode == EXIT_OK, paused.stdout + paused.stderr
        deadline = time.monotonic() + 15
        while not [
            r for r in invoke_json(app, "history", "live")["records"] if r["state"] == "skipped"
        ]:
            assert time.monotonic() < deadline, beats.logs()
            time.sleep(0.5)
        [skipped] = [
            r for r in invoke_json(app, "history", "live")["records"] if r["state"] == "skipped"
        ]
        assert "note: enough; no slot runs until resumed" in skipped["error"]
    finally:
        beats.stop()
        delete_redis_keys(BROKER, beats.queue)


def sent_records(app: Celery, job: str) -> list[dict[str, Any]]:
    return [r for r in invoke_json(app, "history", job)["records"] if r["state"] == "sent"]


@pytest.mark.services
@pytest.mark.parametrize("stored_app", ["mysql", "redis"], indirect=True)
def test_bounds_from_the_command_line_and_finished_jobs_in_jobs(stored_app: Celery) -> None:
    app = stored_app
    added = invoke_json(
        app,
        "add",
        "limited",
        "--task",
        "proj.limited",
        "--every",
        "1m",
        "--start-at",
        "2026-01-01T00:00Z",
        "--end-at",
        "2099-01-01T00:00+01:00",
        "--max-runs",
        "2",
    )
    bounds = added["definition"]["anarchon"]
    assert bounds == {
        "start_at": "2026-01-01T00:00:00.000Z",
        "end_at": "2098-12-31T23:00:00.000Z",
        "max_runs": 2,
    }
    listed = jobs_of(app)["limited"]
    assert listed["runs"] == 0 and listed["finished"] is None
    # Two runs won by the cluster: the job is finished, and says why.
    backend = Control(app).backend
    backend.open()
    for slot in (listed["next"][0]["slot_ms"], listed["next"][1]["slot_ms"]):
        request = Control(app).job("limited").claim_request(slot, 10)
        claim = backend.claim([replace(request, window_before_ms=10**12, window_after_ms=10**12)])
        assert claim[0].won
    backend.close()
    finished = jobs_of(app)["limited"]
    assert finished["finished"] == "max_runs=2 reached" and finished["next"] == []
    assert "finished: max_runs=2 reached" in invoke(app, "jobs").stdout
    # Raising the limit revives it; "none" removes a bound.
    revived = invoke_json(app, "update", "limited", "--max-runs", "none", "--end-at", "none")
    assert revived["definition"]["anarchon"] == {"start_at": "2026-01-01T00:00:00.000Z"}
    assert jobs_of(app)["limited"]["finished"] is None
    assert "no time zone" in fails(app, "update", "limited", "--end-at", "2030-01-01T00:00")
    assert "whole number" in fails(app, "update", "limited", "--max-runs", "two")
    assert "max_runs must be" in fails(app, "update", "limited", "--max-runs", "0")
    assert "before start_at" in fails(app, "update", "limited", "--end-at", "2025-01-01T00:00Z")


def included_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Celery]:
    """An app on SQLite whose Celery ``include`` names a module of its own
    (written to ``tmp_path``) that defines the task ``<module>.hello``,
    taking no arguments; the module's name and the app."""
    module = f"included_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "from celery import shared_task\n\n"
        f"@shared_task(name='{module}.hello')\n"
        "def hello():\n"
        "    return 'hello'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    app = make_app(anarchon_backend=f"sqlite:///{tmp_path / 'claims.db'}", include=[module])
    return module, app


def test_a_task_of_an_included_module_is_known_and_a_typo_is_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A task defined in a module of Celery's ``include`` (imported by a
    worker, not by the app's module) is not reported as unregistered when a
    job is stored; a name no module defines is, once."""
    module, app = included_app(tmp_path, monkeypatch)
    with caplog.at_level("WARNING", logger="celery_anarchon"), Schedules(app) as schedules:
        schedules.add("greet", f"{module}.hello", 60.0)
        assert "not registered" not in caplog.text
        schedules.add("typo", f"{module}.helo", 60.0)
    warned = [r for r in caplog.records if "not registered" in r.getMessage()]
    assert len(warned) == 1 and f"{module}.helo" in warned[0].getMessage()


def test_the_first_add_in_a_process_checks_the_args_of_an_included_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The included modules are imported before the arguments are checked,
    so the first add of a fresh process refuses arguments its task's
    signature refuses (it was let through while the task was unknown)."""
    module, app = included_app(tmp_path, monkeypatch)
    with Schedules(app) as schedules, pytest.raises(ConfigurationError, match="does not take"):
        schedules.add("greet", f"{module}.hello", 60.0, kwargs={"name": "x"})
