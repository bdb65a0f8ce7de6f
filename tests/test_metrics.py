"""Prometheus metrics: the exporter on its own, then scraped from real beats."""

from __future__ import annotations

import logging
import socket
import sys
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_anarchon.backends import backend_from_url
from celery_anarchon.backends.base import SENT_STATES, Backend, State
from celery_anarchon.exceptions import ConfigurationError
from celery_anarchon.metrics import Metrics, PrometheusMetrics, metrics_config, metrics_from_app

from .beat_app import SCHEDULES
from .beats import BeatCluster
from .conftest import REDIS_URL, require_service
from .test_cli import delete_redis_keys

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """GET /metrics on ``port``: ``{(sample name, sorted labels): value}``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def app_with(**conf: object) -> Celery:
    app = Celery("metrics-test", broker="memory://")
    app.conf.update(beat_schedule={"a": {"task": "t", "schedule": 1.0}}, **conf)
    return app


# -- the exporter ---------------------------------------------------------------


def test_every_event_is_a_series_served_over_http() -> None:
    metrics = PrometheusMetrics(port=0, addr="127.0.0.1", jobs=["quiet"])
    try:
        assert metrics.port
        metrics.won("a", 0.3)
        metrics.won("a", 4.0)
        metrics.lost("a")
        metrics.missed("a", 3)
        metrics.skipped("a")
        metrics.superseded("a")
        metrics.send_failed("a")
        metrics.backend_call("claim", 0.002)
        metrics.backend_error("mark")
        samples = scrape(metrics.port)
    finally:
        metrics.close()
    counts = {
        outcome: value(samples, "anarchon_slots_total", job="a", outcome=outcome)
        for outcome in ("won", "lost", "missed", "skipped", "superseded", "send_failed")
    }
    assert counts == {
        "won": 2,
        "lost": 1,
        "missed": 3,
        "skipped": 1,
        "superseded": 1,
        "send_failed": 1,
    }
    # Jobs named at start-up exist at zero before their first event.
    assert value(samples, "anarchon_slots_total", job="quiet", outcome="won") == 0
    assert value(samples, "anarchon_send_lateness_seconds_count") == 2
    assert value(samples, "anarchon_send_lateness_seconds_sum") == pytest.approx(4.3)
    assert value(samples, "anarchon_send_lateness_seconds_bucket", le="0.5") == 1
    assert value(samples, "anarchon_send_lateness_seconds_bucket", le="5.0") == 2
    assert value(samples, "anarchon_backend_call_seconds_count", operation="claim") == 1
    assert value(samples, "anarchon_backend_errors_total", operation="mark") == 1


def test_two_exporters_in_one_process_do_not_collide_and_close_frees_the_port() -> None:
    first = PrometheusMetrics(port=0, addr="127.0.0.1")
    second = PrometheusMetrics(port=0, addr="127.0.0.1")
    port = first.port
    assert port is not None and second.port is not None
    try:
        first.won("a", 0.1)
        assert value(scrape(port), "anarchon_slots_total", job="a", outcome="won") == 1
        assert ("anarchon_slots_total", (("job", "a"), ("outcome", "won"))) not in scrape(
            second.port
        )
    finally:
        first.close()
        first.close()  # twice is fine (beat closes twice on SIGTERM)
        second.close()
    again = PrometheusMetrics(port=port, addr="127.0.0.1")
    again.close()


def test_metrics_are_off_unless_a_port_is_set() -> None:
    metrics = metrics_from_app(app_with())
    assert type(metrics) is Metrics
    assert metrics_config(app_with().conf) is None


@pytest.mark.parametrize("port", [-1, 70000, "http", 8.5, True])
def test_a_bad_port_is_a_configuration_error(port: object) -> None:
    with pytest.raises(ConfigurationError, match="anarchon_metrics_port"):
        metrics_from_app(app_with(anarchon_metrics_port=port))


def test_missing_prometheus_client_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now fails
    with pytest.raises(ConfigurationError, match=r"pip install 'celery-anarchon\[prometheus\]'"):
        metrics_from_app(app_with(anarchon_metrics_port=0))


def test_a_port_in_use_is_logged_and_beat_runs_without_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="celery_anarchon.metrics"):
            metrics = metrics_from_app(
                app_with(anarchon_metrics_port=port, anarchon_metrics_addr="127.0.0.1")
            )
    assert type(metrics) is Metrics
    assert f"cannot serve metrics on 127.0.0.1:{port}" in caplog.text


def test_the_app_settings_serve_on_the_address_given() -> None:
    port = free_port()
    metrics = metrics_from_app(
        app_with(anarchon_metrics_port=port, anarchon_metrics_addr="127.0.0.1")
    )
    try:
        assert isinstance(metrics, PrometheusMetrics) and metrics.port == port
        assert value(scrape(port), "anarchon_slots_total", job="a", outcome="lost") == 0
    finally:
        metrics.close()


# -- scraped from real beats ------------------------------------------------------


@pytest.mark.integration
@pytest.mark.services
def test_two_real_beats_count_every_send_once(tmp_path: Path) -> None:
    """Two beats on one Redis backend, each serving metrics on its own port.
    Each instance's ``won`` count lies between the sends it had recorded
    just before the scrape and the claims it held just after; lateness and
    backend round trips are observed; no backend errors."""
    require_service("redis")
    prefix = f"anarchon-metrics:{uuid.uuid4().hex[:8]}:"
    backend_url = f"{REDIS_URL}?prefix={prefix}"
    ports = [free_port(), free_port()]
    clusters: list[BeatCluster] = []
    for index, port in enumerate(ports):
        folder = tmp_path / f"beat{index}"
        folder.mkdir()
        conf = {"anarchon_metrics_port": port, "anarchon_metrics_addr": "127.0.0.1"}
        cluster = BeatCluster(backend_url, folder, conf=conf)
        if clusters:
            cluster.queue = clusters[0].queue  # one queue, read once
        clusters.append(cluster)
    backend = backend_from_url(backend_url, instance="metrics-test")
    try:
        for cluster in clusters:
            cluster.start(1)
        wait_for_sends(ports, clusters)
        backend.open()
        pid_of = {cluster.procs[0].pid: port for cluster, port in zip(clusters, ports, strict=True)}
        before = sends_by_pid(backend, SENT_STATES)
        scraped = {port: scrape(port) for port in ports}
        after = sends_by_pid(backend, None)
    finally:
        for cluster in clusters:
            cluster.stop()
        backend.close()
        delete_redis_keys(clusters[0].broker, clusters[0].queue)
        delete_redis_keys(REDIS_URL, f"*{prefix}*")
    for cluster in clusters:
        assert cluster.procs[0].returncode == 0, cluster.logs()
    for pid, port in pid_of.items():
        won = {
            job: value(scraped[port], "anarchon_slots_total", job=job, outcome="won")
            for job in SCHEDULES
        }
        for job in SCHEDULES:
            assert before[(pid, job)] <= won[job] <= after[(pid, job)], (job, pid, won)
        assert sum(won.values()) > 0, f"instance {pid} sent nothing"
        # One observation per send (a scrape may fall between the two updates).
        lateness = value(scraped[port], "anarchon_send_lateness_seconds_count")
        assert abs(lateness - sum(won.values())) <= 1
        claims = value(scraped[port], "anarchon_backend_call_seconds_count", operation="claim")
        assert claims > 0
        assert not any(name == "anarchon_backend_errors_total" for name, _ in scraped[port])


def won_by_port(ports: list[int]) -> list[float]:
    """The ``won`` slots of every job, summed, per port."""
    return [
        sum(
            v
            for (name, labels), v in scrape(port).items()
            if name == "anarchon_slots_total" and ("outcome", "won") in labels
        )
        for port in ports
    ]


def wait_for_sends(ports: list[int], clusters: list[BeatCluster]) -> None:
    """Scrape until both beats serve metrics and each has sent slots."""
    deadline = time.monotonic() + 60  # beats start in 5 s or more on a loaded machine
    while True:
        try:
            if min(won_by_port(ports)) >= 2:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("beats did not send in 60 s:\n" + "\n".join(c.logs() for c in clusters))
        time.sleep(0.5)


def sends_by_pid(backend: Backend, states: frozenset[State] | None) -> Counter[tuple[int, str]]:
    """``(pid, job) -> records`` in the backend's history, in ``states``
    (any state when None)."""
    counts: Counter[tuple[int, str]] = Counter()
    for job in SCHEDULES:
        for record in backend.history(job):
            if record.instance and (states is None or record.state in states):
                counts[(int(record.instance.rsplit(":", 2)[1]), job)] += 1
    return counts
