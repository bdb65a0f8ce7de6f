"""Claiming: how many slots one batch claims, the claim itself, and giving
back what a batch could not send in time.

A batch holds at most what this instance claims and sends within a share of
the shortest lease at its measured rate (:meth:`Claimer.limit`, the one
claim cap), so a backup never takes a claim over that is only waiting its
turn. Won claims are *held* until published: a shutdown releases them
(hand-over), a batch running late gives them back (:meth:`Claimer.give_back`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..backends.base import Claim
from ..exceptions import BackendUnavailable
from ..metrics import Metrics
from ..settings import Settings
from ..times import ms as _ms
from .agenda import Agenda, Slot
from .link import BackendLink
from .registry import HAND_OVER_MARGIN

__all__ = [
    "DEADLINE_RETRY_MS",
    "FIRST_SEND_COST",
    "LEASE_SHARE",
    "MAX_CLAIM_BATCH",
    "MIN_CLAIM_BATCH",
    "MIN_SENDS_MEASURED",
    "Claimer",
]

logger = logging.getLogger(__name__)

#: A batch of claims holds at most what this instance claims and sends in
#: ``lease_ttl / LEASE_SHARE`` at its measured rate, so every claim of it is
#: sent long before its lease ends (a backup would take the rest over); the
#: rest of a round waits in the heap for the next batch.
LEASE_SHARE = 4

#: The cost of sending one slot assumed before one is measured, seconds;
#: the smallest batch of claims, and the fewest sends a cost is measured on.
FIRST_SEND_COST = 0.01
MIN_CLAIM_BATCH = 50
MAX_CLAIM_BATCH = 2000
MIN_SENDS_MEASURED = 20

#: A claim the backend answered ``"deadline"`` (it arrived after its
#: deadline, so it claimed nothing) is tried again this much later, ms.
DEADLINE_RETRY_MS = 500


class Claimer:
    """Batch sizing, the batched claim, the held claims, and give-back.

    Args:
        link: the backend.
        agenda: where a slot not claimed now is planned again.
        settings: the settings (``max_skew``).
        metrics: counters and call timings.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        link: BackendLink,
        agenda: Agenda,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._link = link
        self._agenda = agenda
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        #: measured seconds per claimed slot and per sent slot, or None
        self.claim_cost: float | None = None
        self.send_cost: float | None = None
        #: won claims not yet published, by (job, slot): released on shutdown
        self.held: dict[tuple[str, int], Slot] = {}

    def limit(self, slots: Sequence[Slot]) -> int:
        """The most of ``slots`` to claim in one batch: as many as this
        instance claims and sends in ``lease_ttl / LEASE_SHARE`` (the
        shortest lease among them) should it win them all, at its measured
        costs (:data:`FIRST_SEND_COST` per send before one is measured), at
        least :data:`MIN_CLAIM_BATCH`. No limit on a claim-only backend (no
        lease for a backup to take over)."""
        if not self._link.leases:
            return len(slots)
        lease_s = min(slot.job.options.lease_ttl for slot in slots)
        per_slot = (self.claim_cost or 0.0) + (self.send_cost or FIRST_SEND_COST)
        return min(MAX_CLAIM_BATCH, max(MIN_CLAIM_BATCH, int(lease_s / LEASE_SHARE / per_slot)))

    def measure(self, claimed: int, claim_s: float, sent: int, send_s: float) -> None:
        """Fold one batch (``claimed`` slots claimed in ``claim_s`` seconds,
        ``sent`` of them sent and recorded in ``send_s``) into the measured
        costs per slot (small batches are not measured). A cost that rose
        is taken at once, one that fell is averaged in: a slowdown (other
        instances started sending, the machine got busy) shrinks the next
        batch at once."""
        if claimed >= MIN_CLAIM_BATCH:
            self.claim_cost = _average(self.claim_cost, claim_s / claimed)
        if sent >= MIN_SENDS_MEASURED:
            self.send_cost = _average(self.send_cost, send_s / sent)

    def claim(self, batch: Sequence[Slot]) -> list[Claim]:
        """Claim a batch, one answer per slot; the won ones are held
        (:attr:`held`). Never raises: anything but a clear answer counts as
        lost, and a batch the backend did not answer is planned again for
        when it is retried (:meth:`_retry_later`)."""
        lost = [Claim(s.job.name, s.slot_ms, won=False, reason="unknown") for s in batch]
        backend = self._link.backend
        if not self._link.ready or backend is None:
            self._retry_later(batch)
            return lost
        now_ms = int(self._clock() * 1000)
        max_skew = self._settings.max_skew
        requests = [
            s.job.catch_up_request(s.slot_ms, now_ms, max_skew)
            if s.catch_up
            else s.job.claim_request(s.slot_ms, max_skew)
            for s in batch
        ]
        started = time.perf_counter()
        try:
            claims = backend.claim(requests)
        except BackendUnavailable as exc:
            self._metrics.backend_error("claim")
            self._link.on_outage(exc)
            self._retry_later(batch)
            return lost
        except Exception:  # never let a backend bug stop beat; never send unclaimed
            logger.exception("anarchon: claim failed; %d slot(s) not sent", len(batch))
            return lost
        self._metrics.backend_call("claim", time.perf_counter() - started)
        self._link.on_success()
        if len(claims) != len(requests):
            logger.error("anarchon: backend answered %d of %d claims", len(claims), len(batch))
            return lost
        # Held until sent: a shutdown in the middle of this batch releases
        # the rest (hand-over) instead of leaving them to lease expiry.
        for slot, claim in zip(batch, claims, strict=True):
            if claim.won:
                self.hold(slot, claim)
            elif claim.reason == "deadline":
                # The request reached the backend too late and claimed
                # nothing: nobody holds the slot by it, so claim it again.
                self._agenda.again(now_ms + DEADLINE_RETRY_MS, slot)
        return claims

    def hold(self, slot: Slot, claim: Claim) -> None:
        """Hold ``slot``'s won ``claim`` until it is published: a shutdown
        first releases it (hand-over)."""
        slot.claim = claim
        self.held[slot.key] = slot

    def _retry_later(self, batch: Sequence[Slot]) -> None:
        """The backend did not answer: try these claims again when it is
        retried. A slot that is past ``max_late`` by then is recorded
        ``missed`` once the backend answers (never silently dropped)."""
        self._link.not_claimed(slot.key for slot in batch)
        retry_ms = self._link.retry_ms()
        for slot in batch:
            self._agenda.again(retry_ms, slot)

    def hand_over(self, now_ms: int) -> tuple[list[Claim], list[tuple[Claim, str]]]:
        """On shutdown, give up every held claim: ``(to release, to record
        lost with why)``; none is held afterwards.

        A held claim (won, not yet published) whose slot another instance
        can still take within ``max_late`` (at least :data:`HAND_OVER_MARGIN`
        seconds left: the others see this instance leave the registry at
        their next heartbeat) is released, so one takes it at once instead
        of after the lease; a later one is recorded ``lost`` with the
        reason, since nobody could send it any more and a released slot has
        no record."""
        margin_ms = _ms(HAND_OVER_MARGIN)
        release: list[Claim] = []
        lost: list[tuple[Claim, str]] = []
        for slot in self.held.values():
            assert slot.claim is not None
            if now_ms + margin_ms <= slot.job.deadline_ms(slot.slot_ms):
                release.append(slot.claim)
            else:
                lost.append((slot.claim, "shut down before sending; too late to hand over"))
        self.held = {}
        return release, lost

    def give_back(self, rest: Sequence[Slot]) -> None:
        """Release claims a batch could not send in time (fenced: see
        :meth:`Backend.release`) and plan them as claims due now, so this
        instance or another claims them afresh, with a full lease. If the
        release fails they stay claimed, and a backup takes them over when
        their lease ends."""
        backend = self._link.lease_backend
        claims = [slot.claim for slot in rest if slot.claim is not None]
        for slot in rest:
            self.held.pop(slot.key, None)
        try:
            if backend is not None:  # a claim-only backend cannot give a gate back
                backend.release(claims)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
        except Exception:
            logger.exception("anarchon: releasing %d claim(s) failed", len(claims))
        for slot in rest:
            slot.claim = None
            self._agenda.again(slot.slot_ms, slot)
        logger.info(
            "anarchon: gave %d claimed slot(s) back to be claimed afresh: this instance sent "
            "slower than measured, and their leases would run short",
            len(claims),
        )


def _average(old: float | None, sample: float) -> float:
    """A cost's new estimate: the sample when it is higher (or the first),
    else the mean of the old estimate and the sample."""
    return sample if old is None or sample > old else (old + sample) / 2
