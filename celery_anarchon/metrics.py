"""Scheduler metrics: what the scheduler reports, and where it goes.

The scheduler calls a :class:`Metrics` object at each event. The default does
nothing; with ``anarchon_metrics_port`` set, :class:`PrometheusMetrics`
serves them over HTTP for Prometheus to scrape
(``pip install 'celery-anarchon[prometheus]'``).

Settings (Celery config, read once at start-up):

* ``anarchon_metrics_port``: TCP port of the ``/metrics`` endpoint; None
  (default) serves nothing; 0 picks a free port and logs it.
* ``anarchon_metrics_addr``: address to listen on, default ``"0.0.0.0"``
  (all interfaces, so that a Prometheus on another host can scrape it; set
  ``"127.0.0.1"`` to keep it local).

Exported series (``job`` is the ``beat_schedule`` key):

* ``anarchon_slots_total{job, outcome}``: counter, one per slot this instance
  acted on; ``outcome`` is ``won`` (claimed and sent), ``lost`` (another
  instance holds it; normal), ``missed`` (later than ``max_late``), ``skipped``
  (overlap policy), ``superseded`` (taken over from a dead owner) or
  ``send_failed`` (won, but the broker refused it; recorded ``lost``).
* ``anarchon_send_lateness_seconds``: histogram of send time minus slot time,
  seconds, over every slot this instance sent.
* ``anarchon_backend_call_seconds{operation}``: histogram of backend round
  trips (``claim``, ``mark``, ...), seconds.
* ``anarchon_delayed_total{outcome}``: counter of parked tasks this
  instance's releaser ``released``, ``taken_over`` (from an expired lease:
  possibly published twice) or ``failed`` to publish (given back);
* ``anarchon_backend_errors_total{operation}``: counter of backend calls that
  failed (unreachable, timed out).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from .exceptions import ConfigurationError

__all__ = ["Metrics", "PrometheusMetrics", "metrics_config", "metrics_from_app"]

logger = logging.getLogger(__name__)

#: ``outcome`` label values of ``anarchon_slots_total``.
OUTCOMES = ("won", "lost", "missed", "skipped", "superseded", "send_failed")

#: Lateness buckets, seconds: claims go out within ``jitter`` (2 s by
#: default) of the slot, and nothing is sent later than ``max_late`` (60 s).
LATENESS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)

#: Backend round-trip buckets, seconds: a local Redis answers in well under a
#: millisecond, a remote database in a few, a stalled one at its timeout.
BACKEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

#: Default ``anarchon_metrics_addr``: all interfaces.
DEFAULT_ADDR = "0.0.0.0"

_INSTALL = "pip install 'celery-anarchon[prometheus]'"


class Metrics:
    """Receives scheduler events; this base class ignores them.

    Lateness and durations are seconds (float).
    """

    def won(self, job: str, lateness_s: float) -> None:
        """A slot was claimed and sent, ``lateness_s`` after the slot."""

    def lost(self, job: str) -> None:
        """A claim race was lost (another instance holds the slot)."""

    def missed(self, job: str, count: int = 1) -> None:
        """``count`` slots were later than ``max_late``."""

    def skipped(self, job: str) -> None:
        """A slot was skipped by the overlap policy."""

    def superseded(self, job: str) -> None:
        """A slot was taken over from a dead or frozen owner."""

    def send_failed(self, job: str) -> None:
        """A won slot could not be sent (recorded ``lost``)."""

    def backend_call(self, operation: str, seconds: float) -> None:
        """One backend round trip (``claim``, ``mark``, ...) took ``seconds``."""

    def backend_error(self, operation: str) -> None:
        """A backend call failed (unavailable or timed out)."""

    def delayed_released(self, count: int, taken_over: int) -> None:
        """The releaser published and deleted ``count`` parked tasks; it
        took ``taken_over`` over from an expired lease (each of those may
        have been published before: a possible duplicate publish)."""

    def delayed_failed(self, count: int) -> None:
        """``count`` parked tasks could not be published and were given back."""

    def close(self) -> None:
        """Stop serving (if serving)."""


class PrometheusMetrics(Metrics):
    """Metrics as Prometheus series, in a registry of this object's own.

    Each instance has a private ``CollectorRegistry`` (not the library's
    global one), so two schedulers in one process, or tests, never collide,
    and the user's own metrics are not mixed in.

    Args:
        port: serve ``/metrics`` on this TCP port (0: any free port, see
            :attr:`port`); None serves nothing (read :attr:`registry`).
        addr: address to listen on.
        jobs: job names whose series start at zero (so ``rate()`` and
            ``increase()`` see a job before its first event).
    Raises:
        ConfigurationError: ``prometheus_client`` is not installed.
        OSError: the port cannot be bound.
    """

    def __init__(
        self, *, port: int | None = None, addr: str = DEFAULT_ADDR, jobs: Iterable[str] = ()
    ) -> None:
        prometheus = _import_prometheus()
        self.registry = prometheus.CollectorRegistry(auto_describe=True)
        self.slots = prometheus.Counter(
            "anarchon_slots",
            "Slots this instance acted on, by job and outcome "
            "(won, lost, missed, skipped, superseded, send_failed).",
            ["job", "outcome"],
            registry=self.registry,
        )
        self.lateness = prometheus.Histogram(
            "anarchon_send_lateness_seconds",
            "Send time minus slot time of the slots this instance sent, seconds.",
            buckets=LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.backend_seconds = prometheus.Histogram(
            "anarchon_backend_call_seconds",
            "Round-trip time of claim backend calls, seconds, by operation.",
            ["operation"],
            buckets=BACKEND_BUCKETS,
            registry=self.registry,
        )
        self.backend_errors = prometheus.Counter(
            "anarchon_backend_errors",
            "Claim backend calls that failed (unreachable or timed out), by operation.",
            ["operation"],
            registry=self.registry,
        )
        self.delayed = prometheus.Counter(
            "anarchon_delayed",
            "Parked tasks this instance's releaser acted on, by outcome (released, "
            "taken_over: possibly published twice, failed: given back to retry).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("released", "taken_over", "failed"):
            self.delayed.labels(outcome)
        for job in jobs:
            for outcome in OUTCOMES:
                self.slots.labels(job, outcome)
        self._server: Any = None
        self._thread: Any = None
        if port is not None:
            self._server, self._thread = prometheus.start_http_server(
                port, addr, registry=self.registry
            )

    @property
    def port(self) -> int | None:
        """The TCP port ``/metrics`` is served on, or None when not serving."""
        if self._server is None:
            return None
        return int(self._server.server_address[1])

    def won(self, job: str, lateness_s: float) -> None:
        self.slots.labels(job, "won").inc()
        self.lateness.observe(max(lateness_s, 0.0))

    def lost(self, job: str) -> None:
        self.slots.labels(job, "lost").inc()

    def missed(self, job: str, count: int = 1) -> None:
        self.slots.labels(job, "missed").inc(count)

    def skipped(self, job: str) -> None:
        self.slots.labels(job, "skipped").inc()

    def superseded(self, job: str) -> None:
        self.slots.labels(job, "superseded").inc()

    def send_failed(self, job: str) -> None:
        self.slots.labels(job, "send_failed").inc()

    def backend_call(self, operation: str, seconds: float) -> None:
        self.backend_seconds.labels(operation).observe(seconds)

    def backend_error(self, operation: str) -> None:
        self.backend_errors.labels(operation).inc()

    def delayed_released(self, count: int, taken_over: int) -> None:
        self.delayed.labels("released").inc(count)
        if taken_over:
            self.delayed.labels("taken_over").inc(taken_over)

    def delayed_failed(self, count: int) -> None:
        self.delayed.labels("failed").inc(count)

    def close(self) -> None:
        """Stop the HTTP server and free its port. Safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


def _import_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            f"anarchon_metrics_port is set but prometheus_client is not installed: {_INSTALL}"
        ) from exc
    return prometheus_client


def metrics_config(conf: Any) -> tuple[int, str] | None:
    """The ``(port, addr)`` the app's settings ask metrics to be served on,
    or None when ``anarchon_metrics_port`` is unset. Connects nothing.

    Raises:
        ConfigurationError: the port is not a whole number in 0..65535, the
            address is not a string, or ``prometheus_client`` is missing
            (the message gives the pip command).
    """
    port = conf.get("anarchon_metrics_port")
    if port is None:
        return None
    if isinstance(port, str) and port.strip().isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(
            f"anarchon_metrics_port must be a TCP port number (1-65535, or 0 for any free "
            f"port), or None to serve no metrics; got {port!r}."
        )
    addr = conf.get("anarchon_metrics_addr") or DEFAULT_ADDR
    if not isinstance(addr, str):
        raise ConfigurationError(
            f"anarchon_metrics_addr must be an address string such as '0.0.0.0' or "
            f"'127.0.0.1', got {addr!r}."
        )
    _import_prometheus()
    return port, addr


def metrics_from_app(app: Any) -> Metrics:
    """The metrics sink the app's settings ask for.

    A no-op :class:`Metrics` unless ``anarchon_metrics_port`` is set; then a
    :class:`PrometheusMetrics` serving on it. A port that cannot be bound
    (already in use) is logged as an error and the scheduler runs without
    metrics: scheduling matters more than its statistics.

    Raises:
        ConfigurationError: bad metrics settings, or ``prometheus_client``
            is not installed (the message gives the pip command).
    """
    config = metrics_config(app.conf)
    if config is None:
        return Metrics()
    port, addr = config
    try:
        metrics = PrometheusMetrics(port=port, addr=addr, jobs=app.conf.beat_schedule or {})
    except OSError as exc:
        logger.error(
            "anarchon: cannot serve metrics on %s:%s (%s); running without metrics. "
            "Choose a free anarchon_metrics_port (one per process on a host).",
            addr,
            port,
            exc,
        )
        return Metrics()
    logger.info("anarchon: Prometheus metrics on http://%s:%s/metrics", addr, metrics.port)
    return metrics
