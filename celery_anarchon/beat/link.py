"""The claim backend as the beat side uses it: whether it answers, and the
reconnect backoff while it does not.

Every component asks :class:`BackendLink` before a backend call
(:attr:`~BackendLink.ready`) and tells it of an outage
(:meth:`~BackendLink.on_outage`); whether the backend has leases is asked
here once (:attr:`~BackendLink.leases`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from ..backends.base import Backend, LeaseBackend
from ..exceptions import BackendUnavailable, ConfigurationError

__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "BackendLink"]

logger = logging.getLogger(__name__)

#: Reconnect backoff bounds while the backend is away, seconds.
BACKOFF_MIN = 1.0
BACKOFF_MAX = 30.0


class BackendLink:
    """The claim backend, whether it answers, and when to try it again.

    Args:
        backend: the backend, or None until the scheduler's set-up builds it.
        clock: seconds since the epoch.
    """

    def __init__(self, backend: Backend | None, clock: Callable[[], float]) -> None:
        self.backend = backend
        self._clock = clock
        #: True while the backend answers (after a successful probe)
        self.ready = False
        #: when the backend stopped answering (clock seconds), or None
        self._outage_since: float | None = None
        #: the slots, by (job, slot ms), this instance could not claim during
        #: the current outage: each once, however often it was planned again
        self._outage_slots: set[tuple[str, int]] = set()
        #: the next reconnect is not tried before this (clock seconds)
        self.retry_at = 0.0
        self._backoff = BACKOFF_MIN

    @property
    def leases(self) -> bool:
        """True when the backend has leases (backup runners, the registry,
        overlap, catch-up); False on a claim-only backend or none yet."""
        return self.lease_backend is not None

    @property
    def lease_backend(self) -> LeaseBackend | None:
        """The backend, when it has leases (:class:`LeaseBackend`: take
        over, release, extend, holding); None on a claim-only backend or
        none yet."""
        backend = self.backend
        return backend if isinstance(backend, LeaseBackend) else None

    def connect(self, *, strict: bool) -> None:
        """Open the backend and probe it with one real round trip.

        Args:
            strict: start-up has not ended: a ConfigurationError stops beat.
                After it, the problem (a Redis restarted with eviction, a
                changed password) is logged at every retry and beat keeps
                ticking, sending nothing unclaimed.
        Raises:
            ConfigurationError: the backend refused its configuration, when
                ``strict``.
        """
        assert self.backend is not None
        try:
            self.backend.open()
            self.backend.now_ms()  # open() may answer from cache: probe for real
        except BackendUnavailable as exc:
            self.on_outage(exc)
            return
        except ConfigurationError as exc:
            if strict:
                raise
            logger.critical("anarchon: claim backend refused on reconnect: %s", exc)
            self.on_outage(exc)
            return
        self.ready = True
        self.on_success()

    def on_outage(self, exc: BaseException) -> None:
        """The backend did not answer: stop using it until :attr:`retry_at`,
        doubling the backoff (up to :data:`BACKOFF_MAX`) while it stays away."""
        now = self._clock()
        if self._outage_since is None:
            self._outage_since = now
            self._backoff = BACKOFF_MIN
            logger.warning(
                "anarchon: claim backend %s is unavailable (%s); no slot is sent "
                "until it answers again. Retrying with backoff.",
                self.backend.describe() if self.backend else "?",
                exc,
            )
        else:
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self.ready = False
        self.retry_at = now + self._backoff

    def not_claimed(self, keys: Iterable[tuple[str, int]]) -> None:
        """Count slots, by ``(job, slot ms)``, this instance could not claim
        during the current outage; one planned again and refused again is
        counted once (the "back" line says how many)."""
        self._outage_slots.update(keys)

    @property
    def outage_lost(self) -> int:
        """How many distinct slots this instance could not claim during the
        current outage."""
        return len(self._outage_slots)

    def on_success(self) -> None:
        """The backend answered: end the outage (logged) and reset the backoff."""
        if self._outage_since is not None:
            logger.warning(
                "anarchon: claim backend is back after %.1fs; %d slot(s) were not "
                "sent by this instance meanwhile",
                self._clock() - self._outage_since,
                self.outage_lost,
            )
        self._outage_since = None
        self._outage_slots.clear()
        self._backoff = BACKOFF_MIN

    def retry_ms(self) -> int:
        """When work the backend did not answer is tried again: at the next
        reconnect, at least a second from now, epoch ms."""
        return max(int(self.retry_at * 1000), int(self._clock() * 1000) + 1000)
