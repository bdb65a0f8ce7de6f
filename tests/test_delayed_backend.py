"""``anarchon_delayed_backend``: claims on RabbitMQ, parked tasks in Redis.

Real services: a real ``celery beat`` whose claims are on RabbitMQ releases
tasks parked in Redis to a real worker on a RabbitMQ broker, once each; a
RabbitMQ-only set-up refuses ``park`` with the setting to set and starts
beat without a releaser; ``celery anarchon check`` reports where parked
tasks live; a bad URL stops beat naming the setting.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_anarchon import delayed
from celery_anarchon.cli import EXIT_CONFIG, EXIT_OK, EXIT_PROBLEM, EXIT_UNREACHABLE
from celery_anarchon.exceptions import ConfigurationError

from .beats import BeatCluster
from .conftest import RABBIT_URL, REDIS_URL, RUN_ID, require_service
from .test_cli import invoke, invoke_json
from .test_delayed import stamped

pytestmark = pytest.mark.services


def redis_store_url(tag: str) -> str:
    """A Redis URL with a prefix under the run's (conftest's clean-up drops it)."""
    return f"{REDIS_URL}?prefix=anarchon-test:{RUN_ID}:{tag}:"


def rabbit_claims_url(tag: str) -> str:
    return f"{RABBIT_URL}?prefix=dl.{tag}."


def make_app(broker: str = "memory://", **conf: Any) -> Celery:
    app = Celery(f"delayed-backend-{uuid.uuid4().hex[:6]}", broker=broker)
    app.conf.update({"task_default_queue": "delayed-backend-unused", "timezone": "UTC", **conf})
    return app


@pytest.fixture
def rabbit(request: pytest.FixtureRequest) -> str:
    """The run's RabbitMQ vhost (the claims' and the broker's), Redis for
    the parked tasks."""
    require_service("rabbitmq")
    require_service("redis")
    request.getfixturevalue("_redis_cleanup")
    vhost: str = request.getfixturevalue("rabbit_vhost")
    return vhost


# -- a RabbitMQ set-up with its parked tasks in Redis ----------------------------------


def test_a_beat_on_rabbitmq_releases_tasks_parked_in_redis_to_a_worker_once(
    rabbit: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    claims, parked_in = rabbit_claims_url(tag), redis_store_url(tag)
    conf = {"beat_schedule": {}, "anarchon_delayed_backend": parked_in}
    cluster = BeatCluster(claims, tmp_path, conf=conf, broker=RABBIT_URL)
    app = make_app(
        RABBIT_URL,
        anarchon_backend=claims,
        anarchon_delayed_backend=parked_in,
        task_default_queue=cluster.queue,
    )
    out = tmp_path / "stamps.txt"
    store, _ = delayed.store_for(app)
    try:
        assert store.kind == "redis" and "RedisBackend" in store.describe()
        cluster.start(1)
        cluster.start_worker()
        assert cluster.wait_ticking(timeout=60), cluster.logs()
        due = time.time() + 3
        ids = delayed.park_many(
            app,
            [
                {"task": "itest.stamp", "args": (str(out), str(int(due * 1000))), "countdown": 3}
                for _ in range(20)
            ],
        )
        keyed = delayed.park(
            app, "itest.stamp", (str(out), str(int(due * 1000))), countdown=3, key="invoice-7"
        )
        assert delayed.park(app, "itest.stamp", (str(out), "0"), key="invoice-7") == keyed
        found = delayed.get(app, "invoice-7")
        assert found is not None and found.id == keyed
        assert delayed.count(app) == 21
        ids.append(keyed)
        first = delayed.get(app, ids[0])
        assert first is not None
        parking = first.decoded()["parking"]
        deadline = time.time() + 60
        while len(stamped(out)) < len(ids) and time.time() < deadline:
            time.sleep(0.3)
        # A second delivery of a released task (the same headers, as a
        # take-over publishes them): the worker's gate, on the same Redis
        # store, discards it.
        app.send_task(
            "itest.stamp",
            (str(out), "0"),
            task_id=ids[0],
            queue=cluster.queue,
            headers={"anarchon_delayed": "test", "anarchon_parking": parking},
        )
        time.sleep(3)
        runs = stamped(out)
        left = delayed.count(app)
        beat_log = cluster.log_path(cluster.procs[0]).read_text()
        worker_log = (tmp_path / "worker-1.log").read_text()
    finally:
        store.close()
        cluster.stop_workers()
        cluster.stop()
    executed = Counter(task_id for _, task_id, _ in runs)
    assert set(executed) == set(ids), cluster.logs()
    assert max(executed.values()) == 1, cluster.logs()
    assert [ms for tag_ms, _, ms in runs if ms < int(tag_ms)] == []  # never early
    assert left == 0
    # The claims are on RabbitMQ, the parked tasks in Redis.
    assert "RabbitMQBackend" in beat_log
    assert "releasing parked tasks from delayed store in RedisBackend" in beat_log
    assert "delayed tasks are off" not in beat_log
    assert f"discarded a second delivery of released task {ids[0]}" in worker_log


# -- RabbitMQ without anarchon_delayed_backend -------------------------------------------


@pytest.mark.parametrize(
    "conf",
    [
        {"anarchon_backend": "amqp://app:s3cret@127.0.0.1:5672/prod"},
        {"broker_url": "amqp://app:s3cret@127.0.0.1:5672/prod"},  # the broker's by default
    ],
    ids=["anarchon_backend", "broker"],
)
def test_park_on_rabbitmq_alone_is_refused_with_the_setting_to_set(conf: dict[str, Any]) -> None:
    app = make_app(**conf)
    with pytest.raises(ConfigurationError) as refused:
        delayed.park(app, "tests.add", (1, 2), countdown=5)
    message = str(refused.value)
    for part in (
        "anarchon_backend is RabbitMQ",
        "anarchon_delayed_backend",
        "cannot cancel, reschedule or find a parked task by key",
        delayed.RABBITMQ_DOC,
        'anarchon_delayed_backend = "redis://',
        "postgresql://",
    ):
        assert part in message, message
    assert "s3cret" not in message and "app:**@127.0.0.1" in message
    for call in (
        lambda: delayed.count(app),
        lambda: delayed.get(app, "k"),
        lambda: delayed.cancel(app, "k"),
    ):
        with pytest.raises(ConfigurationError, match="anarchon_delayed_backend"):
            call()


def test_the_commands_refuse_rabbitmq_alone_with_exit_4() -> None:
    app = make_app(anarchon_backend="amqp://app:s3cret@127.0.0.1:5672/prod")
    result = invoke(app, "delayed", "count")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "anarchon_delayed_backend" in result.stderr and "s3cret" not in result.stderr


def test_a_rabbitmq_delayed_backend_is_refused_by_name() -> None:
    app = make_app(
        anarchon_backend=REDIS_URL, anarchon_delayed_backend="amqp://app:s3cret@127.0.0.1//"
    )
    with pytest.raises(ConfigurationError) as refused:
        delayed.park(app, "tests.add", (1, 2), countdown=5)
    message = str(refused.value)
    assert message.startswith("anarchon_delayed_backend = 'amqp://app:**@127.0.0.1//' is RabbitMQ")
    assert "s3cret" not in message


@pytest.mark.parametrize("own_url", [False, True])
def test_the_delayed_store_says_what_it_is_when_it_opens(
    own_url: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Beat and a worker open the claim backend and the delayed store apart,
    also on one URL: their start-up lines say which is which."""
    require_service("redis")
    from celery_anarchon.delayed import delayed_backend
    from celery_anarchon.delayed.settings import DelayedSettings
    from celery_anarchon.settings import Settings

    conf = {"anarchon_delayed_backend": redis_store_url("role")} if own_url else {}
    app = make_app(anarchon_backend=redis_store_url("role-claims"), **conf)
    backend = delayed_backend(
        Settings.from_app(app), DelayedSettings.from_app(app), instance="role-test"
    )
    try:
        with caplog.at_level("INFO", logger="celery_anarchon"):
            backend.open()
    finally:
        backend.close()
    ready = [r.getMessage() for r in caplog.records if " ready: " in r.getMessage()]
    assert len(ready) == 1 and ready[0].startswith("anarchon: Redis delayed store ready: "), ready


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("redus://127.0.0.1:6379/0", "unknown URL scheme 'redus'"),
        ("redis://127.0.0.1:6379/0?prefx=x", "prefx"),
        (42, "must be a backend URL"),
    ],
)
def test_a_bad_delayed_backend_is_refused_by_name(value: Any, expected: str) -> None:
    app = make_app(anarchon_backend=REDIS_URL, anarchon_delayed_backend=value)
    with pytest.raises(ConfigurationError) as refused:
        delayed.park(app, "tests.add", (1, 2), countdown=5)
    message = str(refused.value)
    assert message.startswith("anarchon_delayed_backend"), message
    assert expected in message


def test_beat_on_rabbitmq_alone_starts_without_a_releaser_and_says_why_once(
    rabbit: str, tmp_path: Path
) -> None:
    cluster = BeatCluster(
        rabbit_claims_url(uuid.uuid4().hex[:6]),
        tmp_path,
        conf={"beat_schedule": {"every-second": {"task": "itest.noop", "schedule": 1.0}}},
        broker=RABBIT_URL,
    )
    try:
        cluster.start(1)
        assert cluster.wait_ticking(timeout=60), cluster.logs()
        time.sleep(2.5)  # a few ticks: the line is not repeated
        running = cluster.running()
        log = cluster.log_path(cluster.procs[0]).read_text()
    finally:
        cluster.stop()
    assert running == cluster.procs, cluster.logs()
    off = [line for line in log.splitlines() if "delayed tasks are off" in line]
    assert len(off) == 1, log
    assert "INFO" in off[0] and "anarchon_delayed_backend" in off[0]
    assert "releasing parked tasks" not in log
    assert "anarchon: sent every-second @" in log  # the claims go on


# -- check ------------------------------------------------------------------------------


def test_check_reports_where_parked_tasks_live() -> None:
    app = make_app(
        anarchon_backend="amqp://guest:guest@127.0.0.1:5672//",
        anarchon_delayed_backend="redis://:s3cret@127.0.0.1:6379/0?prefix=app:",
    )
    report = invoke_json(app, "check")
    assert report["ok"] is True
    where = report["delayed_backend"]
    assert "RedisBackend" in where and "prefix='app:'" in where and "s3cret" not in where
    assert "RabbitMQBackend" in report["backend"]
    assert not any("delayed tasks are off" in w for w in report["warnings"])
    same = invoke_json(make_app(anarchon_backend=REDIS_URL), "check")
    assert "RedisBackend" in same["delayed_backend"]  # the claim backend's own store


def test_check_warns_that_rabbitmq_alone_keeps_no_parked_tasks() -> None:
    app = make_app(anarchon_backend="amqp://app:s3cret@127.0.0.1:5672//")
    report = invoke_json(app, "check")
    assert report["ok"] is True and report["delayed_backend"] is None
    [off] = [w for w in report["warnings"] if "delayed tasks are off" in w]
    assert "anarchon_delayed_backend" in off and "s3cret" not in off
    text = invoke(app, "check")
    assert text.exit_code == EXIT_OK
    assert "WARNING  delayed tasks are off" in text.output


def test_check_names_a_bad_delayed_backend() -> None:
    app = make_app(
        anarchon_backend=REDIS_URL, anarchon_delayed_backend="redus://:s3cret@127.0.0.1:6379/0"
    )
    report = invoke_json(app, "check", code=EXIT_PROBLEM)
    [problem] = report["problems"]
    assert problem["where"] == "anarchon_delayed_backend"
    assert "Did you mean 'redis'" in problem["message"]
    assert "s3cret" not in problem["message"]
    assert report["delayed_backend"] is None


def test_check_connect_reaches_the_delayed_backend_or_exits_3() -> None:
    require_service("redis")
    fine = make_app(anarchon_backend=REDIS_URL, anarchon_delayed_backend=redis_store_url("chk"))
    report = invoke_json(fine, "check", "--connect")
    assert report["ok"] is True and report["unreachable"] is False
    down = make_app(
        anarchon_backend=REDIS_URL, anarchon_delayed_backend="redis://:s3cret@127.0.0.1:1/0"
    )
    result = invoke(down, "check", "--connect")
    assert result.exit_code == EXIT_UNREACHABLE, result.output
    assert "unreachable" in result.output and "s3cret" not in result.output


# -- start-up -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("redus://127.0.0.1:6379/0", "Did you mean 'redis'"), (42, "must be a backend URL")],
    ids=["scheme", "not-a-string"],
)
def test_a_bad_delayed_backend_stops_beat_naming_the_setting(
    value: Any, expected: str, tmp_path: Path
) -> None:
    require_service("redis")
    cluster = BeatCluster(
        redis_store_url(uuid.uuid4().hex[:6]),
        tmp_path,
        conf={"beat_schedule": {}, "anarchon_delayed_backend": value},
    )
    [proc] = cluster.start(1)
    try:
        code = proc.wait(60)
    finally:
        cluster.stop()
    log = cluster.log_path(proc).read_text()
    assert code == 1, log
    critical = [line for line in log.splitlines() if "CRITICAL" in line]
    assert any("anarchon_delayed_backend" in line and expected in line for line in critical), log


# -- the comparison's benchmark -----------------------------------------------------------


def test_the_levels_planner_decomposes_a_delay_over_rocketmqs_levels() -> None:
    from bench.rabbitmq_delays import plan

    assert plan(95_000) == ([60, 30, 5], 0)
    assert plan(3_700) == ([1, 1, 1], 700)
    assert plan(4_995) == ([1, 1, 1, 1], 995)  # a hop a few ms late costs hops ...
    assert plan(4_995, slack_ms=50) == ([5], 0)  # ... unless a level may be a little long
    assert len(plan(30 * 86_400_000)[0]) == 360  # a month is 360 hops of 2 h


def test_the_rabbitmq_delays_bench_runs_on_a_tiny_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import shutil

    from bench import rabbitmq_delays

    require_service("rabbitmq")
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed")
    out = tmp_path / "delays.json"
    args = ["--long", "2", "--short", "0.3", "--count", "2", "--delays", "0.4,1.5"]
    assert rabbitmq_delays.main([*args, "--per-delay", "2", "--json", str(out)]) == 0
    assert "| behind the long one |" in capsys.readouterr().out
    results = json.loads(out.read_text())
    blocked = [r for r in results["head_of_line"]["blocked"] if r["label"] != "long"]
    alone = results["head_of_line"]["alone"]
    assert len(blocked) == len(alone) == 2
    assert min(r["after_ms"] for r in blocked) >= 2000  # behind the 2 s message
    assert max(r["after_ms"] for r in alone) < 2000
    for variant in results["levels"]:
        assert len(variant["arrived"]) == 4
        assert min(r["late_ms"] for r in variant["arrived"]) >= -rabbitmq_delays.DUE_MS
