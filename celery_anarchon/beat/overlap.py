"""Overlap protection: ``overlap='skip'`` skips a slot while the job's
previous run is still in flight (docs/scheduling.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..backends.base import Claim, RunRecord, State
from ..exceptions import BackendUnavailable
from ..message import message_expiry_ms
from ..metrics import Metrics
from ..model import Job
from ..settings import Settings
from ..times import iso as _iso
from ..times import ms as _ms
from .journal import Journal
from .link import BackendLink

__all__ = ["NOT_RUN", "SENT_IN_FLIGHT", "Overlap"]

logger = logging.getLogger(__name__)

#: How long a run that was sent but never started counts as in flight for
#: ``overlap='skip'``, seconds (a worker backlog of up to an hour).
SENT_IN_FLIGHT = 3600.0

#: Records of slots that were never run (skipped by policy or missed).
NOT_RUN = frozenset({State.MISSED, State.SKIPPED})


class Overlap:
    """Decides, per slot of an ``overlap='skip'`` job, whether to skip it.

    Args:
        link: the backend (the job's history).
        journal: where a skipped slot, or a dead run, is recorded.
        settings: the settings (``max_skew``).
        metrics: counters.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        link: BackendLink,
        journal: Journal,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._link = link
        self._journal = journal
        self._settings = settings
        self._metrics = metrics
        self._clock = clock

    def skip(self, job: Job, slot_ms: int, claiming: dict[str, int]) -> bool:
        """With ``overlap='skip'``: True (and ``slot_ms`` recorded
        ``skipped``) while the job's previous run is in flight; always False
        for ``overlap='allow'``. Catch-up slots are checked too.

        In flight: claimed with a live lease; sent and not started for less
        than :data:`SENT_IN_FLIGHT` seconds; running with a live lease (the
        worker integration extends it). A running run whose lease ended is
        recorded ``lost`` (its worker died) and frees the job. An earlier
        slot of the job going to the backend in the same batch
        (``claiming``: job -> slot ms, kept up to date here) is in flight
        too: catch-up puts several slots of one job in one batch.
        """
        if job.options.overlap != "skip":
            return False
        earlier = claiming.get(job.name)
        if earlier is not None and earlier < slot_ms:
            previous_ms, state = earlier, "being claimed"
        else:
            backend = self._link.backend
            if backend is None or not self._link.ready:
                return False
            try:
                history = backend.history(job.name, limit=job.options.history_size)
            except BackendUnavailable as exc:
                self._link.on_outage(exc)
                return False
            runs = (r for r in history if r.slot_ms < slot_ms and r.state not in NOT_RUN)
            previous = next(runs, None)
            if previous is None or not self._in_flight(previous, job):
                claiming[job.name] = slot_ms
                return False
            previous_ms, state = previous.slot_ms, str(previous.state)
        if self._journal.record_if_absent(job, slot_ms, State.SKIPPED, f"previous run {state}"):
            self._metrics.skipped(job.name)
            logger.warning(
                "anarchon: skipped %s @ %s: the run of %s is still %s (overlap='skip')",
                job.name,
                _iso(slot_ms),
                _iso(previous_ms),
                state,
            )
        return True

    def _in_flight(self, run: RunRecord, job: Job) -> bool:
        """Whether ``run`` (``job``'s previous run) still blocks a new slot
        under ``overlap='skip'``: claimed with a live lease; sent for less
        than :data:`SENT_IN_FLIGHT` seconds and its message not expired
        (``expires`` plus ``max_skew``); running with a live lease (a
        running run whose lease ended is recorded ``lost`` here)."""
        now_ms = int(self._clock() * 1000)
        lease_alive = run.lease_until_ms is None or run.lease_until_ms > now_ms
        if run.state is State.CLAIMED:
            return lease_alive
        if run.state is State.SENT:
            if (run.sent_at_ms or 0) + _ms(SENT_IN_FLIGHT) <= now_ms:
                return False
            # A worker revokes a message that reaches it after its expiry
            # (the worker integration records that run lost): it never
            # starts. Judged with max_skew to spare, for a worker's clock.
            expiry_ms = message_expiry_ms(
                (job.entry.options or {}).get("expires"),
                job.expires(run.slot_ms),
                run.sent_at_ms,
            )
            return expiry_ms is None or expiry_ms + _ms(self._settings.max_skew) > now_ms
        if run.state is State.RUNNING:
            if lease_alive:
                return True
            token = run.token if isinstance(run.token, int) else None
            dead = Claim(run.job, run.slot_ms, won=True, token=token)
            if self._journal.mark(dead, State.LOST, error="worker lease expired while running"):
                logger.warning(
                    "anarchon: run of %s @ %s was running but its lease ended: recorded lost",
                    job.name,
                    _iso(run.slot_ms),
                )
            return False
        return False
