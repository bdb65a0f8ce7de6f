"""Settings: defaults, Django's CELERY_ prefix, per-job overrides, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from celery import Celery

from celery_anarchon.backends import backend_from_url
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.settings import Settings, default_backend_url, started_by_beat
from celery_anarchon.times import option_seconds

REPO = Path(__file__).resolve().parents[1]


def make_app(**conf: object) -> Celery:
    app = Celery("settings-test", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults_match_the_design() -> None:
    s = Settings.from_app(make_app(), schedule_filename="/srv/beat/celerybeat-schedule")
    d = s.defaults
    assert (d.jitter, d.max_late, d.history_size) == (2.0, 60.0, 100)
    assert d.history_ttl == 7 * 24 * 3600
    assert (d.overlap, d.catch_up, d.catch_up_window, d.catch_up_limit) == (
        "allow",
        "none",
        24 * 3600,
        100,
    )
    assert s.max_skew == 10.0
    assert s.backend == "sqlite:////srv/beat/celerybeat-schedule.anarchon.db"
    assert s.explicit == frozenset()


@pytest.mark.parametrize(
    ("broker", "expected"),
    [
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("rediss://:pw@cache:6380/2", "rediss://:pw@cache:6380/2"),
        ("amqp://guest:guest@rabbit:5672//", "amqp://guest:guest@rabbit:5672//"),
        ("pyamqp://rabbit//", "pyamqp://rabbit//"),
        ("filesystem://", "sqlite:///"),
        ("sqs://", "sqlite:///"),
    ],
)
def test_default_backend_follows_a_redis_or_rabbitmq_broker(broker: str, expected: str) -> None:
    url = default_backend_url(make_app(broker_url=broker).conf, "/b/celerybeat-schedule")
    assert url.startswith(expected)


def test_failover_broker_list_uses_the_first_url() -> None:
    conf = make_app(broker_url="redis://a:6379/0;redis://b:6379/0").conf
    assert default_backend_url(conf, None) == "redis://a:6379/0"


def test_django_celery_prefix_is_read() -> None:
    class DjangoSettings:
        CELERY_ANARCHON_JITTER = 0.5
        CELERY_ANARCHON_MAX_LATE = timedelta(seconds=30)
        CELERY_ANARCHON_BACKEND = "redis://cache:6379/3"

    app = Celery("django-style", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    s = Settings.from_app(app)
    assert (s.defaults.jitter, s.defaults.max_late) == (0.5, 30.0)
    assert s.backend == "redis://cache:6379/3"
    assert "jitter" in s.explicit


def test_timedelta_and_numbers_are_seconds() -> None:
    s = Settings.from_app(
        make_app(anarchon_jitter=timedelta(milliseconds=250), anarchon_max_late=5)
    )
    assert (s.defaults.jitter, s.defaults.max_late) == (0.25, 5.0)


def test_per_job_overrides() -> None:
    s = Settings.from_app(make_app())
    anchor = datetime(2026, 1, 1, 6, tzinfo=timezone.utc)
    o = s.job_options("sync", {"jitter": 0, "max_late": 5, "anchor": anchor, "history_size": 7})
    assert (o.jitter, o.max_late, o.history_size) == (0.0, 5.0, 7)
    assert o.anchor_ms == int(anchor.timestamp() * 1000)
    assert s.job_options("other", None) == s.defaults


@pytest.mark.parametrize(
    ("conf", "words"),
    [
        ({"anarchon_jitter": "2s"}, ["anarchon_jitter", "number of seconds"]),
        ({"anarchon_max_late": -1}, ["anarchon_max_late", "negative"]),
        ({"anarchon_history_size": 0}, ["anarchon_history_size", ">= 1"]),
        ({"anarchon_overlap": "queue"}, ["anarchon_overlap", "'allow'", "'skip'"]),
        ({"anarchon_catch_up": "some"}, ["anarchon_catch_up", "'latest'"]),
        ({"anarchon_lease_ttl": 0}, ["anarchon_lease_ttl"]),
        ({"anarchon_backend_options": ["prefix"]}, ["anarchon_backend_options", "dict"]),
    ],
)
def test_bad_global_settings_are_refused(conf: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigurationError) as err:
        Settings.from_app(make_app(**conf))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"jitters": 1}, ["'nightly'", "jitters", "Did you mean 'jitter'", "Allowed"]),
        ({"max_late": "soon"}, ["'nightly'", "max_late"]),
        ({"overlap": "wait"}, ["'nightly'", "overlap"]),
        ({"anchor": datetime(2026, 1, 1)}, ["'nightly'", "anchor", "naive"]),
        ("fast", ["'nightly'", "must be a dict"]),
    ],
)
def test_bad_per_job_options_name_the_job(overrides: object, words: list[str]) -> None:
    s = Settings.from_app(make_app())
    with pytest.raises(ConfigurationError) as err:
        s.job_options("nightly", overrides)  # type: ignore[arg-type]
    for word in words:
        assert word in str(err.value)


def test_a_misspelled_setting_is_refused_with_a_suggestion() -> None:
    with pytest.raises(
        ConfigurationError, match="anarchon_max_lat.*Did you mean 'anarchon_max_late'"
    ):
        Settings.from_app(make_app(anarchon_max_lat=30))


def test_a_misspelled_django_setting_is_refused() -> None:
    class DjangoSettings:
        CELERY_ANARCHON_JITER = 1

    app = Celery("django-typo", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="Did you mean 'CELERY_ANARCHON_JITTER'"):
        Settings.from_app(app)


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("0", False), ("yes", True)])
def test_boolean_settings_read_strings_as_written(value: str, expected: bool) -> None:
    s = Settings.from_app(make_app(anarchon_allow_eviction=value, anarchon_worker_strict=value))
    assert (s.allow_eviction, s.worker_strict) == (expected, expected)


def test_a_boolean_setting_of_another_word_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="anarchon_allow_eviction must be True or False"):
        Settings.from_app(make_app(anarchon_allow_eviction="maybe"))


def test_started_by_beat_is_false_outside_celery_beat() -> None:
    assert started_by_beat() is False


BAD_APP = """
from celery import Celery
from celery_anarchon import cron

app = Celery("badapp", broker="memory://")
app.conf.anarchon_backend = "sqlite:///{db}"
app.conf.anarchon_max_lateness = 30
app.conf.beat_schedule = {{"bad": {{"task": "t", "schedule": cron("61 * * * *")}}}}
"""


def test_a_configuration_error_stops_beat_in_a_few_lines(tmp_path: Path) -> None:
    (tmp_path / "badapp.py").write_text(BAD_APP.format(db=tmp_path / "claims.db"))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "badapp", "beat", "-S", "anarchon", "-l", "INFO"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Did you mean 'anarchon_max_late'?" in out
    assert "cannot read cron '61 * * * *'" in out
    assert "Traceback" not in out
    assert len(out.splitlines()) < 30, out


@pytest.mark.parametrize(
    ("query", "typo", "suggestion"),
    [
        ("prefix=x:&socket_timout=3", "socket_timout", "socket_timeout"),
        ("health_check_intervl=5", "health_check_intervl", "health_check_interval"),
        ("prefx=x:", "prefx", "prefix"),
    ],
)
def test_a_misspelled_redis_url_query_parameter_is_refused_with_a_suggestion(
    query: str, typo: str, suggestion: str
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        backend_from_url(f"redis://:s3cret@127.0.0.1:6379/12?{query}", instance="i")
    message = str(caught.value)
    assert f"unknown URL query parameter(s) {typo}." in message
    assert f"Did you mean {suggestion!r}?" in message
    assert "s3cret" not in message and "unexpected keyword" not in message


def test_redis_py_connection_arguments_in_the_url_query_are_accepted() -> None:
    url = (
        "redis://127.0.0.1:6379/12?prefix=x:&socket_connect_timeout=2"
        "&health_check_interval=10&max_connections=4&client_name=beat"
    )
    backend = backend_from_url(url, instance="i")
    assert backend.prefix == "x:"  # type: ignore[attr-defined]
    tls = "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/tmp/ca.pem"
    assert "rediss://127.0.0.1:6380/0" in backend_from_url(tls, instance="i").describe()


@pytest.mark.parametrize(
    ("value", "expected"), [(5, 5.0), ("2.5", 2.5), (timedelta(minutes=1), 60.0)]
)
def test_a_backend_options_duration_takes_numbers_url_strings_and_timedeltas(
    value: object, expected: float
) -> None:
    assert option_seconds("socket_timeout", value) == expected


@pytest.mark.parametrize("value", [0, -1, "abc", None, True, float("nan"), float("inf"), 7200])
def test_a_backend_options_duration_is_refused_by_name(value: object) -> None:
    with pytest.raises(
        ConfigurationError, match=r"anarchon_backend_options\['statement_timeout'\]"
    ):
        option_seconds("statement_timeout", value, most=3600)
