"""Scheduler metrics: what the scheduler reports, and where it goes.

The scheduler calls a :class:`Metrics` object at each event. The default does
nothing; with ``anarchon_metrics_port`` set, a Prometheus exporter serves
them (``pip install 'celery-anarchon[prometheus]'``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Metrics", "metrics_from_app"]


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

    def close(self) -> None:
        """Stop serving (if serving)."""


def metrics_from_app(app: Any) -> Metrics:
    """The metrics sink the app's settings ask for (a no-op by default)."""
    return Metrics()
