"""``celery anarchon`` commands against real backends, with history written
by real ``celery beat`` processes; ``check`` on every bad-input case."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import InstanceInfo
from celery_anarchon.cli import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    anarchon,
)
from celery_anarchon.message import task_id_for

from .beat.support import Unserializable
from .beat_app import SCHEDULES
from .beats import BROKER, REPO, BeatCluster, read_queue
from .conftest import MYSQL_URL, POSTGRES_URL, REDIS_URL, require_service

#: Registry TTL of the test beats, seconds (the shortest allowed): a beat
#: killed with SIGKILL drops out of ``status`` this long after its last
#: heartbeat.
REGISTRY_TTL_S = 10


#: Every Redis key these tests write starts with this (deleted at the end).
REDIS_PREFIX = f"anarchon-cli:{uuid.uuid4().hex[:8]}:"


def redis_backend() -> str:
    """A Redis backend URL with a namespace of its own."""
    return f"{REDIS_URL}?prefix={REDIS_PREFIX}{uuid.uuid4().hex[:8]}:"


@pytest.fixture(scope="module", autouse=True)
def _clean_redis() -> Iterator[None]:
    yield
    delete_redis_keys(REDIS_URL, f"*{REDIS_PREFIX}*")


def delete_redis_keys(url: str, pattern: str) -> None:
    """Delete the keys matching ``pattern`` (nothing when Redis is down)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        for key in client.scan_iter(match=pattern, count=1000):
            client.delete(key)
        client.close()
    except redis.RedisError:
        pass


def make_app(**conf: Any) -> Celery:
    """An app like ``tests.beat_app``'s, with ``conf`` on top."""
    app = Celery("itest")
    app.conf.update(
        broker_url=BROKER,
        task_default_queue="cli-test",
        task_ignore_result=True,
        timezone="UTC",
        beat_schedule={
            name: {"task": "itest.noop", "schedule": schedule}
            for name, schedule in SCHEDULES.items()
        },
    )
    app.conf.update(conf)
    return app


def invoke(app: Celery, *args: str) -> Result:
    """Run ``celery anarchon ARGS`` in-process on ``app`` (Celery's CLI
    context, as ``celery -A`` builds it)."""
    return CliRunner().invoke(
        anarchon,
        list(args),
        obj=CLIContext(app=app, no_color=True, workdir=None),
        catch_exceptions=False,
    )


def invoke_json(app: Celery, *args: str, code: int = EXIT_OK) -> Any:
    result = invoke(app, *args, "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


# -- check: every bad input ---------------------------------------------------------

BAD_ENTRIES = [
    ("bad-cron", {"task": "t", "schedule": "0 0 31 2 *"}, "never matches"),
    ("unparsable", {"task": "t", "schedule": "every day"}, "cannot read cron 'every day'"),
    ("zero-interval", {"task": "t", "schedule": 0}, "interval 0"),
    ("negative-interval", {"task": "t", "schedule": -5.0}, "interval -5"),
    ("nan-interval", {"task": "t", "schedule": float("nan")}, "interval nan s is not a finite"),
    (
        "infinite-interval",
        {"task": "t", "schedule": float("inf")},
        "interval inf s is not a finite",
    ),
    ("tiny-interval", {"task": "t", "schedule": 0.001}, "below the floor of 0.1 s"),
    ("tiny-timedelta", {"task": "t", "schedule": timedelta(milliseconds=50)}, "interval 0.05 s"),
    ("no-task", {"schedule": 5.0}, "no 'task'; every entry needs a task"),
    ("args-not-a-list", {"task": "t", "schedule": 5, "args": 5}, "['args']: expected a list"),
    ("kwargs-not-a-dict", {"task": "t", "schedule": 5, "kwargs": [1]}, "['kwargs']: expected a"),
    ("unknown-option", {"task": "t", "schedule": 5, "anarchon": {"jiter": 1}}, "jiter"),
    ("unknown-entry-key", {"task": "t", "schedul": 5}, "Did you mean 'schedule'"),
    (
        "jitter-over-max-late",
        {"task": "t", "schedule": 5, "anarchon": {"jitter": 30, "max_late": 30}},
        "jitter (30.0s) must be below",
    ),
]


def test_check_names_args_the_serializer_refuses() -> None:
    """Issue 12, item 1: ``check`` passed args that JSON cannot encode; each
    entry's args and kwargs are now encoded once with its serializer."""
    app = check_app()
    app.conf.beat_schedule = {
        **app.conf.beat_schedule,
        "nonjson": {"task": "t", "schedule": 5.0, "args": [Unserializable()]},
        "nonjson-kwargs": {"task": "t", "schedule": 5.0, "kwargs": {"x": Unserializable()}},
        "pickled": {
            "task": "t",
            "schedule": 5.0,
            "args": [Unserializable()],
            "options": {"serializer": "pickle"},
        },
    }
    report = invoke_json(app, "check", code=EXIT_PROBLEM)
    problems = {p["where"]: p["message"] for p in report["problems"]}
    assert set(problems) == {"beat_schedule['nonjson']", "beat_schedule['nonjson-kwargs']"}
    for message in problems.values():
        assert "serializer 'json' refuses its args or kwargs" in message
        assert "Unserializable is not JSON serializable" in message
        assert "Fix:" in message


def test_check_names_args_the_task_does_not_take() -> None:
    app = check_app()

    @app.task(name="t.none")
    def takes_nothing() -> None:
        """Takes no arguments."""

    app.conf.beat_schedule = {"extra": {"task": "t.none", "schedule": 5.0, "args": [1]}}
    report = invoke_json(app, "check", code=EXIT_PROBLEM)
    [problem] = report["problems"]
    assert problem["where"] == "beat_schedule['extra']"
    assert "task 't.none' does not take its args or kwargs" in problem["message"]


@pytest.mark.services
def test_check_connect_fails_for_a_wrong_redis_password() -> None:
    """Issue 12, item 6: a Redis ACL user with a wrong password is a
    configuration problem for ``check --connect``, as for beat, with the
    URL masked (an ACL user of its own: the shared Redis keeps its
    default user's settings)."""
    require_service("redis")
    import redis

    user = f"anarchon-test-{uuid.uuid4().hex[:6]}"
    client = redis.Redis.from_url(REDIS_URL)
    client.acl_setuser(
        user, enabled=True, passwords=["+secret"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    try:
        url = f"redis://{user}:wrong@127.0.0.1:6379/0?prefix=anarchon-auth:"
        result = invoke(check_app(anarchon_backend=url), "check", "--connect")
        good = f"redis://{user}:secret@127.0.0.1:6379/0?prefix=anarchon-auth:"
        fine = invoke_json(check_app(anarchon_backend=good), "check", "--connect")
    finally:
        client.acl_deluser(user)
        client.close()
    assert result.exit_code == EXIT_PROBLEM, result.output
    assert "refused the credentials" in result.output
    assert "wrong" not in result.output.replace("wrong-", "")
    assert fine["connected"] is True


def check_app(**conf: Any) -> Celery:
    app = Celery("check-test", broker="memory://")
    app.conf.update(
        anarchon_backend="redis://127.0.0.1:6379/0",
        beat_schedule={"fine": {"task": "t", "schedule": "*/5 * * * *"}},
    )
    app.conf.update(conf)
    return app


def test_check_passes_a_valid_configuration() -> None:
    result = invoke(check_app(), "check")
    assert result.exit_code == EXIT_OK, result.output
    assert "checked 1 valid job(s)" in result.output
    assert "(not connected)" in result.output
    report = invoke_json(check_app(), "check")
    assert report["ok"] is True and report["problems"] == [] and report["jobs"] == 1


@pytest.mark.parametrize(("job", "entry", "message"), BAD_ENTRIES, ids=[b[0] for b in BAD_ENTRIES])
def test_check_names_each_bad_entry(job: str, entry: dict[str, Any], message: str) -> None:
    app = check_app()
    app.conf.beat_schedule = {**app.conf.beat_schedule, job: entry}
    result = invoke(app, "check")
    assert result.exit_code == EXIT_PROBLEM, result.output
    assert f"beat_schedule[{job!r}]" in result.output and message in result.output
    report = invoke_json(app, "check", code=EXIT_PROBLEM)
    assert report["ok"] is False and report["jobs"] == 1  # the good job still counts
    assert [p["where"] for p in report["problems"]] == [f"beat_schedule[{job!r}]"]  # one each


GLOBAL_CASES = [
    ({"anarchon_backend": "redsi://127.0.0.1:6379/0"}, "anarchon_backend", "Did you mean 'redis'"),
    ({"anarchon_jitter": 70}, "settings", "anarchon_jitter (70.0s) must be below"),
    ({"anarchon_max_late": -1}, "settings", "must not be negative"),
    ({"timezone": "Mars/Olympus_Mons"}, "timezone", "unknown time zone"),
    ({"anarchon_registry_ttl": 3}, "anarchon_registry_ttl", "at least 10s"),
    ({"anarchon_metrics_port": 99999}, "anarchon_metrics_port", "TCP port"),
    # Every lease-only feature is refused by name on RabbitMQ (claim-only).
    *(
        (
            {"anarchon_backend": "amqp://guest:guest@127.0.0.1:5672//", setting: value},
            "beat_schedule['fine']",
            f"{named} need a lease backend",
        )
        for setting, value, named in [
            ("anarchon_overlap", "skip", "overlap='skip'"),
            ("anarchon_lease_ttl", 20, "lease_ttl (backup runners)"),
            ("anarchon_catch_up", "latest", "catch_up='latest'"),
            (
                "anarchon_history_ttl",
                3600,
                "history_ttl (RabbitMQ history is trimmed by size only)",
            ),
        ]
    ),
]


@pytest.mark.parametrize(
    ("conf", "where", "message"), GLOBAL_CASES, ids=[c[1] for c in GLOBAL_CASES]
)
def test_check_names_each_bad_setting(conf: dict[str, Any], where: str, message: str) -> None:
    report = invoke_json(check_app(**conf), "check", code=EXIT_PROBLEM)
    assert [p["where"] for p in report["problems"]] == [where], report
    assert message in report["problems"][0]["message"]


def test_check_suggests_a_django_style_setting_in_the_form_written() -> None:
    """``namespace='CELERY'`` settings: a typo is one problem, and the
    suggestion is the uppercase name the user would write."""

    class DjangoSettings:
        CELERY_BROKER_URL = "memory://"
        CELERY_ANARCHON_BACKEND = "redis://127.0.0.1:6379/0"
        CELERY_ANARCHON_JITER = 1
        CELERY_BEAT_SCHEDULE = {"fine": {"task": "t", "schedule": "*/5 * * * *"}}

    app = Celery("django-style")
    app.config_from_object(DjangoSettings, namespace="CELERY")
    result = invoke(app, "check")
    assert result.exit_code == EXIT_PROBLEM, result.output
    assert "CELERY_ANARCHON_JITER: unknown setting" in result.output
    assert "Did you mean 'CELERY_ANARCHON_JITTER'?" in result.output
    assert "'anarchon_jitter'" not in result.output
    assert "checked 1 valid job(s)" in result.output


def test_jobs_shows_a_weekly_interval_in_days_with_its_anchor_and_cron_seconds() -> None:
    from datetime import timedelta

    app = check_app(
        beat_schedule={
            "weekly": {"task": "t", "schedule": timedelta(days=7)},
            "every-2s": {"task": "t", "schedule": "* * * * * */2"},
            "five": {"task": "t", "schedule": "*/5 * * * *"},
        },
    )
    text = invoke(app, "jobs").stdout
    assert "schedule  every 7d: Thursdays 00:00 UTC (anchor 1970-01-01T00:00:00Z)" in text
    assert "604800s" not in text
    assert "cron '* * * * * */2' (with seconds; day-of-month OR day-of-week) UTC" in text
    assert "cron '*/5 * * * *' (POSIX) UTC" in text


def test_status_names_the_app_it_runs_with(tmp_path: Path) -> None:
    require_service("redis")
    app = make_app(anarchon_backend=redis_backend())
    result = CliRunner().invoke(
        anarchon,
        ["status"],
        obj=CLIContext(app=app, no_color=True, workdir=None),
        catch_exceptions=False,
    )
    assert result.exit_code == EXIT_PROBLEM, result.output
    assert "Start `celery -A itest beat -S celery_anarchon.Scheduler`" in result.output
    assert "-A proj" not in result.output


def test_check_reports_every_problem_at_once() -> None:
    app = check_app(anarchon_backend="redsi://x", anarchon_jitter=70)
    app.conf.beat_schedule = {name: entry for name, entry, _ in BAD_ENTRIES}
    report = invoke_json(app, "check", code=EXIT_PROBLEM)
    wheres = [p["where"] for p in report["problems"]]
    assert "settings" in wheres and "anarchon_backend" in wheres
    assert {f"beat_schedule[{name!r}]" for name, _, _ in BAD_ENTRIES} <= set(wheres)


def test_check_warns_that_sqlite_is_one_host_only(tmp_path: Path) -> None:
    app = check_app(anarchon_backend=f"sqlite:///{tmp_path / 'claims.db'}")
    report = invoke_json(app, "check")
    assert report["ok"] is True
    assert any("local SQLite file" in w for w in report["warnings"])


@pytest.mark.services
def test_check_connect_reaches_the_backend_or_exits_3() -> None:
    require_service("redis")
    report = invoke_json(check_app(anarchon_backend=REDIS_URL), "check", "--connect")
    assert report["connected"] is True
    down = check_app(anarchon_backend="redis://:s3cret@127.0.0.1:1/0")
    result = invoke(down, "check", "--connect")
    assert result.exit_code == EXIT_UNREACHABLE, result.output
    assert "unreachable" in result.output and "s3cret" not in result.output


# -- errors of every command ----------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["history", "every-second"],
        ["last-run", "every-second"],
        ["run-now", "every-second"],
        ["status"],
    ],
)
def test_an_unreachable_backend_is_one_masked_line_and_exit_3(args: list[str]) -> None:
    app = make_app(anarchon_backend="redis://:s3cret@127.0.0.1:1/0")
    result = invoke(app, *args)
    assert result.exit_code == EXIT_UNREACHABLE
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "claim backend unreachable" in result.stderr
    assert "s3cret" not in result.stderr and ":**@127.0.0.1:1" in result.stderr
    error = invoke_json(app, *args, code=EXIT_UNREACHABLE)
    assert error["exit_code"] == EXIT_UNREACHABLE and "s3cret" not in error["error"]


def test_a_broken_configuration_exits_4_and_points_to_check() -> None:
    app = make_app(anarchon_backend="redis://127.0.0.1:1/0", anarchon_jitter=99)
    result = invoke(app, "jobs")
    assert result.exit_code == EXIT_CONFIG
    assert "anarchon_jitter" in result.stderr and "celery -A proj anarchon check" in result.stderr


@pytest.mark.parametrize(
    "args", [["jobs"], ["history", "minutely"], ["last-run", "minutely"], ["status"]]
)
def test_read_only_commands_never_create_the_sqlite_file(tmp_path: Path, args: list[str]) -> None:
    """A command run from another folder than beat's reads another default
    SQLite path: it says there is no backend there instead of creating one."""
    path = tmp_path / "celerybeat-schedule.anarchon.db"
    app = make_app(anarchon_backend=f"sqlite:///{path}")
    result = invoke(app, *args)
    assert not path.exists(), f"{args} created {path}"
    if args != ["jobs"]:  # jobs connects to nothing
        assert result.exit_code == EXIT_UNREACHABLE, result.output
        assert "does not exist" in result.stderr and str(path) in result.stderr
        assert "first start" in result.stderr
    else:
        assert result.exit_code == EXIT_OK, result.output


@pytest.mark.parametrize("command", ["jobs", "history minutely", "last-run minutely", "status"])
def test_a_command_without_an_app_says_that_a_is_missing(tmp_path: Path, command: str) -> None:
    """``celery anarchon status`` (no -A) gets Celery's default app: it
    says -A is missing and leaves no file behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "APP"))}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "anarchon", *command.split()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "no app given" in done.stderr and "celery -A proj anarchon" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.services
def test_an_unknown_job_is_a_usage_error() -> None:
    require_service("redis")
    app = make_app(anarchon_backend=redis_backend())
    for command in ("history", "last-run", "run-now"):
        result = invoke(app, command, "every-secnd")
        assert result.exit_code == EXIT_USAGE, result.output
        assert "Did you mean 'every-second'?" in result.stderr


# -- run-now, history, last-run on each lease backend ------------------------------------


@pytest.mark.services
@pytest.mark.parametrize("name", ["sqlite", "postgresql", "mysql", "redis"])
def test_run_now_sends_once_per_key_and_shows_in_history(name: str, tmp_path: Path) -> None:
    require_service("redis")  # the broker
    require_service(name)
    run = uuid.uuid4().hex[:8]
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=cli{run}_",
        "mysql": f"{MYSQL_URL}?prefix=cli{run}_",
        "redis": redis_backend(),
    }[name]
    queue = f"cli-{run}"
    app = make_app(anarchon_backend=url, task_default_queue=queue)
    try:
        first = invoke_json(app, "run-now", "minutely", "--key", "deploy-42")
        again = invoke(app, "run-now", "minutely", "--key", "deploy-42")
        assert first["sent"] is True and first["key"] == "deploy-42"
        assert again.exit_code == EXIT_PROBLEM and "was used before" in again.stdout
        assert first["task_id"] in again.stdout
        sent = read_queue(BROKER, queue, timeout=1.0)
        assert [h["anarchon_job"] for h in sent] == ["minutely"]
        records = invoke_json(app, "history", "minutely")["records"]
        assert len(records) == 1 and records[0]["manual_key"] == "deploy-42"
        assert records[0]["state"] == "sent" and records[0]["task_id"] == first["task_id"]
        last = invoke_json(app, "last-run", "minutely")["run"]
        assert last["task_id"] == first["task_id"]
        table = invoke(app, "history", "minutely").stdout
        assert "run-now key=deploy-42" in table and first["task_id"] in table
        nothing = invoke(app, "last-run", "every-second")
        assert nothing.exit_code == EXIT_PROBLEM and "no run sent yet" in nothing.stdout
    finally:
        if name in {"postgresql", "mysql"}:
            drop_tables(url, f"cli{run}_")


@pytest.mark.services
def test_two_default_key_run_now_calls_across_a_second_boundary_send_once(
    tmp_path: Path,
) -> None:
    """Two quick ``run-now`` calls from the command line, the second in
    another second than the first: one sends, the other is refused because
    the job's previous manual run is younger than ``anarchon_run_now_guard``."""
    require_service("redis")
    beats = BeatCluster(redis_backend(), tmp_path)

    def run_now() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.beat_app", "anarchon"]
            + ["run-now", "minutely"],
            cwd=REPO,
            env=beats.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        first_started = int(time.time())
        first = run_now()
        while int(time.time()) == first_started:  # the second call in another second
            time.sleep(0.05)
        second = run_now()
        assert first.returncode == EXIT_OK, first.stdout + first.stderr
        assert second.returncode == EXIT_PROBLEM, second.stdout + second.stderr
        assert "anarchon_run_now_guard" in second.stdout and "--key" in second.stdout
        sent = read_queue(BROKER, beats.queue, timeout=1.0)
        assert [h["anarchon_job"] for h in sent] == ["minutely"]
    finally:
        delete_redis_keys(BROKER, beats.queue)


@pytest.mark.services
@pytest.mark.parametrize("name", ["sqlite", "postgresql", "mysql", "redis", "rabbitmq"])
def test_concurrent_default_key_run_now_calls_send_once(name: str, tmp_path: Path) -> None:
    """Calls racing on separate connections: the guard is taken in the
    backend, so exactly one sends; once the guard has passed, a call sends."""
    import threading

    from celery_anarchon.control import Control

    require_service("redis")  # the broker
    require_service(name)
    run = uuid.uuid4().hex[:8]
    url = {
        "sqlite": f"sqlite:///{tmp_path / 'claims.db'}",
        "postgresql": f"{POSTGRES_URL}?prefix=cli{run}_",
        "mysql": f"{MYSQL_URL}?prefix=cli{run}_",
        "redis": redis_backend(),
        "rabbitmq": f"amqp://guest:guest@127.0.0.1:5672//?prefix=cli{run}.",
    }[name]
    queue = f"cli-{run}"
    app = make_app(anarchon_backend=url, task_default_queue=queue, anarchon_run_now_guard=2)
    controls = [Control(app) for _ in range(4)]
    for control in controls:  # connected (and tables made) before the race
        control.backend.open()
    barrier = threading.Barrier(len(controls))
    results: list[Any] = []

    def call(control: Control) -> None:
        barrier.wait()
        results.append(control.run_now("minutely"))

    try:
        threads = [threading.Thread(target=call, args=(c,)) for c in controls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(results) == len(controls)
        assert sum(r.sent for r in results) == 1, results
        time.sleep(2.2)
        assert controls[0].run_now("minutely").sent is True  # the guard has passed
        sent = read_queue(BROKER, queue, timeout=1.0)
        assert [h["anarchon_job"] for h in sent] == ["minutely", "minutely"]
    finally:
        for control in controls:
            control.close()
        if name in {"postgresql", "mysql"}:
            drop_tables(url, f"cli{run}_")


def drop_tables(url: str, prefix: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url.split("?")[0].replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        for table in sa.inspect(conn).get_table_names():
            if table.startswith(prefix):
                conn.execute(sa.text(f"DROP TABLE {table}"))
    engine.dispose()


# -- status: drift and skew in the registry ----------------------------------------------


@pytest.mark.services
def test_status_warns_about_clock_skew_and_definitions_that_differ() -> None:
    """Two registered instances (written straight into a real Redis
    registry): one clock 30 s ahead, one job defined differently."""
    require_service("redis")
    url = redis_backend()
    app = make_app(anarchon_backend=url, anarchon_max_skew=10)
    backend = backend_from_url(url, instance="status-test")
    backend.open()
    try:
        now = int(time.time() * 1000)
        for index, (skew_ms, definition) in enumerate([(0, "aaaa"), (30_000, "bbbb")]):
            backend.register(
                InstanceInfo(
                    instance=f"host{index}:{100 + index}:abcdef",
                    host=f"host{index}",
                    pid=100 + index,
                    version="0.1.0",
                    started_ms=now,
                    clock_ms=now + skew_ms,
                    fingerprint=definition,
                    jobs={"shared": "same", "changed": definition},
                ),
                60_000,
            )
        report = invoke_json(app, "status", code=EXIT_PROBLEM)
        offsets = {i["instance"]: i["offset_ms"] for i in report["instances"]}
        assert abs(offsets["host0:100:abcdef"]) < 1000
        assert 29_000 < offsets["host1:101:abcdef"] < 31_000
        assert [d["job"] for d in report["drift"]] == ["changed"]
        clocks = [w for w in report["warnings"] if "clock" in w]
        assert len(clocks) == 1 and "instance host1:101:abcdef: clock +30" in clocks[0]
        assert any("'changed' is defined differently" in w for w in report["warnings"])
        table = invoke(app, "status")
        assert table.exit_code == EXIT_PROBLEM
        assert "jobs defined differently between instances:" in table.stdout
        assert "changed: host0:100:abcdef=aaaa, host1:101:abcdef=bbbb" in table.stdout
    finally:
        backend.unregister("host0:100:abcdef")
        backend.unregister("host1:101:abcdef")
        backend.close()


# -- the commands on a running cluster of real beats ----------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BeatCluster]:
    """Two real beats on Redis, running until each job has history."""
    require_service("redis")
    url = redis_backend()
    beats = BeatCluster(
        url, tmp_path_factory.mktemp("beats"), conf={"anarchon_registry_ttl": REGISTRY_TTL_S}
    )
    beats.start(2)
    app = cluster_app(beats)
    try:
        # Two beats start in 5 s or more on a loaded machine (imports).
        deadline = time.monotonic() + 60
        while len(invoke_json(app, "history", "every-second")["records"]) < 4:
            if time.monotonic() > deadline:
                pytest.fail("the beats sent nothing in 60 s:\n" + beats.logs())
            time.sleep(0.5)
        yield beats
    finally:
        beats.stop()
        delete_redis_keys(BROKER, beats.queue)  # the messages the beats sent


def cluster_app(beats: BeatCluster) -> Celery:
    return make_app(anarchon_backend=beats.backend, task_default_queue=beats.queue, **beats.conf)


def cli(beats: BeatCluster, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.beat_app anarchon ARGS`` as an operator runs it,
    in the environment the beats run in (the entry point, the real app)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.beat_app", "anarchon", *args],
        cwd=REPO,
        env=beats.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.integration
@pytest.mark.services
def test_jobs_shows_schedules_zones_next_slots_and_options(cluster: BeatCluster) -> None:
    before = int(time.time() * 1000)
    report = invoke_json(cluster_app(cluster), "jobs")
    jobs = {job["name"]: job for job in report["jobs"]}
    assert set(jobs) == set(SCHEDULES)
    assert "anarchon-cli:" in report["backend"] and report["supports_leases"] is True
    every = [slot["slot_ms"] for slot in jobs["every-second"]["next"]]
    assert len(every) == 3 and every[0] > before and every[1] - every[0] == 1000
    minutely = [slot["slot_ms"] for slot in jobs["minutely"]["next"]]
    assert [s % 60_000 for s in minutely] == [0, 0, 0] and minutely[1] - minutely[0] == 60_000
    assert jobs["minutely"]["zone"] == "UTC" and jobs["minutely"]["schedule"].startswith("cron")
    assert jobs["every-second"]["options"]["jitter"] == 2.0
    assert jobs["every-second"]["next"][0]["utc"].endswith("Z")
    text = invoke(cluster_app(cluster), "jobs").stdout
    assert "schedule  every 1s (anchor 1970-01-01T00:00:00Z)" in text
    assert "options   jitter=2s max_late=60s overlap=allow catch_up=none" in text


@pytest.mark.integration
@pytest.mark.services
def test_history_and_last_run_show_what_the_beats_sent(cluster: BeatCluster) -> None:
    app = cluster_app(cluster)
    pids = {proc.pid for proc in cluster.procs}
    records = invoke_json(app, "history", "every-second", "--limit", "3")["records"]
    assert len(records) == 3
    slots = [r["slot_ms"] for r in records]
    assert slots == sorted(slots, reverse=True) and len(set(slots)) == 3
    for record in records:
        assert record["state"] in {"claimed", "sent"}
        assert int(record["instance"].rsplit(":", 2)[1]) in pids
        namespace = backend_from_url(cluster.backend, instance="cli").namespace
        task_id = task_id_for("every-second", record["slot_ms"], namespace=namespace)
        assert record["task_id"] in (None, task_id)
        assert record["slot"].endswith("Z") and record["claimed_at_ms"] >= record["slot_ms"]
    # The beats keep sending: last-run lies between two reads of the history.
    before = sent_slots(app, "every-second")
    last = invoke_json(app, "last-run", "every-second")["run"]
    after = sent_slots(app, "every-second")
    assert before[0] <= last["slot_ms"] <= after[0] and last["slot_ms"] in after
    assert last["state"] == "sent" and last["sent_at_ms"] >= last["slot_ms"]
    table = invoke(app, "history", "every-second", "-n", "2")
    assert table.exit_code == EXIT_OK
    lines = table.stdout.splitlines()
    assert lines[1].split() == [
        "SLOT",
        "(UTC)",
        "STATE",
        "INSTANCE",
        "CLAIMED",
        "SENT",
        "STARTED",
        "FINISHED",
        "TASK",
        "ID",
        "NOTE",
    ]
    assert len(lines) == 4


@pytest.mark.integration
@pytest.mark.services
def test_status_shows_each_running_beat_and_drops_it_once_stopped(cluster: BeatCluster) -> None:
    """Through the real entry point: both beats listed with their pids,
    clocks and fingerprint; one leaves at once on SIGTERM; one killed with
    SIGKILL drops out after the registry TTL; with none left, exit 1."""
    first, second = cluster.procs
    status = cli(cluster, "status", "--json")
    assert status.returncode == EXIT_OK, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert {i["pid"] for i in report["instances"]} == {first.pid, second.pid}
    for instance in report["instances"]:
        assert instance["fingerprint"] == report["local_fingerprint"]
        assert abs(instance["offset_ms"]) < 1000  # one host, one clock
        assert instance["heartbeat_age_ms"] < 8000
    assert report["backend_clock"] is True and report["probe"]["rtt_ms"] < 1000
    table = invoke(cluster_app(cluster), "status").stdout
    assert "live instances: 2" in table and f" {first.pid} " in table

    cluster.stop([first], signal.SIGTERM)
    assert pids_in_status(cluster) == {second.pid}  # unregistered on the way out

    second.send_signal(signal.SIGKILL)
    second.wait(10)
    assert pids_in_status(cluster) == {second.pid}  # still within its TTL
    deadline = time.monotonic() + REGISTRY_TTL_S + 5
    while pids_in_status(cluster):
        assert time.monotonic() < deadline, "a killed beat stayed in the registry"
        time.sleep(1)
    final = invoke(cluster_app(cluster), "status")
    assert final.exit_code == EXIT_PROBLEM
    assert "live instances: 0" in final.stdout and "no live instance" in final.stdout


def sent_slots(app: Celery, job: str) -> list[int]:
    """The slots of ``job`` recorded as sent, newest first."""
    records = invoke_json(app, "history", job)["records"]
    return [r["slot_ms"] for r in records if r["state"] == "sent"]


def pids_in_status(beats: BeatCluster) -> set[int]:
    report = json.loads(invoke(cluster_app(beats), "status", "--json").stdout)
    return {instance["pid"] for instance in report["instances"]}


def test_check_connect_reports_a_bad_backend_url_as_a_configuration_error() -> None:
    app = check_app(anarchon_backend="redis://127.0.0.1:6379/12?prefix=x:&socket_timout=3")
    result = invoke(app, "check", "--connect")
    assert result.exit_code == EXIT_PROBLEM, result.output
    assert "backend not built: configuration error" in result.output
    assert "unreachable" not in result.output
    assert "Did you mean 'socket_timeout'?" in result.output


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "celery_anarchon", "demo", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_demo_removes_its_temporary_folder_after_a_good_run(tmp_path: Path) -> None:
    done = _demo(tmp_path, "--instances", "2", "--seconds", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "duplicates=0 missed=0" in done.stdout
    assert list(tmp_path.glob("anarchon-demo-*")) == []
    # "sent per instance" counts the slots of the summary: it adds up to sent=.
    per_instance = done.stdout.split("sent per instance: ")[1].splitlines()[0]
    sent = int(done.stdout.split(" sent=")[1].split()[0])
    assert sum(int(part.rsplit("=", 1)[1]) for part in per_instance.split(", ")) == sent


def test_the_demo_keeps_its_folder_when_the_run_fails(tmp_path: Path) -> None:
    # No beat at all: every slot is missed, so the run fails.
    done = _demo(tmp_path, "--instances", "0", "--seconds", "8")
    assert done.returncode == 1, done.stdout + done.stderr
    [folder] = tmp_path.glob("anarchon-demo-*")
    assert f"logs kept in {folder}" in done.stdout
    assert (folder / "worker.log").exists()


def test_the_demo_keeps_a_folder_given_with_dir(tmp_path: Path) -> None:
    folder = tmp_path / "kept"
    done = _demo(tmp_path, "--instances", "1", "--seconds", "9", "--dir", str(folder))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (folder / "beat-1.log").exists() and (folder / "executions.log").read_text()
