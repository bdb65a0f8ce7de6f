"""Backup runners: taking a slot over when its owner died.

An instance that lost a slot to another watches it (:meth:`TakeOver.watch`)
until the owner's lease ends; then, if the owner never recorded a send, it
takes the slot over (fenced) and sends it. The slot's rendezvous order
staggers the backups' checks, so a healthy cluster spends at most
:data:`TAKE_OVER_RANKS` checks per slot. Past ``max_late`` an unsent slot is
recorded ``lost`` instead (docs/how-it-works.md, "Backup take-over").
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

from ..backends.base import Claim, ClaimRequest, State
from ..exceptions import BackendUnavailable
from ..metrics import Metrics
from ..model import Job
from ..settings import Settings
from ..times import iso as _iso
from ..times import ms as _ms
from .agenda import TAKE_OVER, Agenda, Slot
from .journal import Journal
from .link import BackendLink
from .publisher import Publisher
from .registry import HEARTBEAT_INTERVAL, Registry

__all__ = ["TAKE_OVER_GRAIN_MS", "TAKE_OVER_RANKS", "TakeOver"]

logger = logging.getLogger(__name__)

#: Take-over checks fall due on multiples of this, milliseconds (batched).
TAKE_OVER_GRAIN_MS = 500

#: The instances of a slot's rendezvous order (0 = preferred) that check a
#: lost slot at once when its lease ends (ranks 0 and 1), one heartbeat
#: period later (rank 2), whatever the registry says. A later rank ``r``
#: checks ``r - 1`` heartbeat periods after the lease's end (at the last
#: chance before ``max_late`` at the latest) only if an instance it saw live
#: when it lost the slot has left the registry or stopped heartbeating by
#: then; so a healthy cluster spends at most three checks per slot, and the
#: slot is still checked whoever died.
TAKE_OVER_RANKS = 3


class TakeOver:
    """The slots this instance backs up, and their checks.

    Args:
        link: the backend.
        agenda: where checks are planned.
        registry: the peers and this instance's rank for a slot.
        journal: where a slot lost past ``max_late`` is recorded.
        publisher: sends a slot taken over.
        settings: the settings (``max_skew``).
        metrics: counters.
        clock: seconds since the epoch.
        rng: randomness for spreading the checks.
    """

    def __init__(
        self,
        link: BackendLink,
        agenda: Agenda,
        registry: Registry,
        journal: Journal,
        publisher: Publisher,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._link = link
        self._agenda = agenda
        self._registry = registry
        self._journal = journal
        self._publisher = publisher
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._random = rng
        #: slots lost to another owner and due a check, by (job, slot); a
        #: slot's ``seen`` is set when this instance checks it only if a
        #: peer died (its rank is TAKE_OVER_RANKS or later)
        self.watching: dict[tuple[str, int], Slot] = {}

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def watch(self, job: Job, slot_ms: int, now_ms: int, *, again: bool = False) -> None:
        """After losing ``slot_ms`` (or, ``again``, after a check found
        another holder's lease still running), plan to check it once that
        lease ends: if its holder died before recording its send, this
        instance takes the slot over. When the lease outlives ``max_late``,
        the check falls just after ``max_late`` and records the slot
        ``lost`` if its lease ended unsent (:meth:`_record_lost`).

        With a registry, the slot's rendezvous order staggers the checks:
        ranks 0 and 1 check at the lease's end (plus a random part of the
        jitter), rank 2 one heartbeat period later, a later rank ``r``
        ``r - 1`` periods later (at the last chance before ``max_late`` at
        the latest) and only if one of the peers it saw live has died by
        then (:data:`TAKE_OVER_RANKS`). A second check (``again``) falls at
        the lease's end whatever the rank."""
        if not self._link.leases:
            return
        peers = self._registry.peers
        rank = 0 if again or len(peers) < 2 else self._registry.rank(job.name, slot_ms)
        lease_ms = _ms(job.options.lease_ttl)
        last_ms = job.deadline_ms(slot_ms)
        # Due a check at once should a peer leave the registry (it hands
        # the slot over on shutdown, or died), until max_late.
        slot = Slot(job, slot_ms, TAKE_OVER, seen=peers if rank >= TAKE_OVER_RANKS else None)
        self.watching[slot.key] = slot
        if now_ms + lease_ms > last_ms:
            # The lease outlives max_late: checked just after it (recorded
            # lost if the lease ended unsent), or at once on a hand-over.
            self._agenda.push(last_ms + 1, slot)
            return
        delay_ms = self._random.randint(0, _ms(job.options.jitter) or 1)
        stage_ms = max(rank - 1, 0) * _ms(HEARTBEAT_INTERVAL)
        last_chance_ms = max(now_ms + lease_ms, last_ms - TAKE_OVER_GRAIN_MS)
        due_ms = min(now_ms + lease_ms + delay_ms + stage_ms, last_chance_ms)
        # Rounded up to TAKE_OVER_GRAIN_MS, so the checks of one round fall
        # due together and go to the backend as a few batches, not one each.
        due_ms = -(-due_ms // TAKE_OVER_GRAIN_MS) * TAKE_OVER_GRAIN_MS
        self._agenda.push(min(due_ms, last_ms), slot)

    def check_now(self) -> None:
        """A peer left the registry (hand-over on shutdown) or stopped
        heartbeating: check the slots this instance backs up at once
        instead of at lease expiry."""
        now_ms = self._now_ms()
        for slot in self.watching.values():
            self._agenda.push(now_ms, slot)

    def _forget(self, slot: Slot) -> None:
        self.watching.pop(slot.key, None)

    def check(self, due: Sequence[Slot], now_ms: int) -> None:
        """Check the take-overs due in this round with one batched call
        (:meth:`Backend.take_over_many`: slots already sent are answered
        from one read) and send the slots taken over. A slot whose lease
        another holder still has (``"held"``: maybe a backup that took it
        over) is checked again at that lease's end. A slot past ``max_late``
        goes to :meth:`_record_lost`. A check of a late rank
        (:data:`TAKE_OVER_RANKS`) is made only once a peer died, else moved
        a heartbeat period on, and dropped at ``max_late``. One the backend
        did not answer is checked again when the backend is retried."""
        todo: list[Slot] = []
        late: list[Slot] = []
        for event in due:
            slot = self.watching.get(event.key)
            if slot is None:
                continue  # settled by an earlier check
            last_ms = slot.job.deadline_ms(slot.slot_ms)
            if slot.seen is not None and not self._registry.peer_died(slot.seen):
                if now_ms + _ms(HEARTBEAT_INTERVAL) < last_ms:
                    self._agenda.push(now_ms + _ms(HEARTBEAT_INTERVAL), slot)
                else:  # every peer it saw is alive: they check it
                    self._forget(slot)
                continue
            (late if now_ms > last_ms else todo).append(slot)
        if late:
            self._record_lost(late, now_ms)
        if not todo:
            return
        if not self._link.ready:
            self._retry(todo)
            return
        max_skew = self._settings.max_skew
        claims = self._take_over_many([s.job.claim_request(s.slot_ms, max_skew) for s in todo])
        if claims is None:
            self._retry(todo)
            return
        claimed_at = self._clock()
        for slot, claim in zip(todo, claims, strict=True):
            if claim.reason in ("unknown", "deadline"):
                self._retry([slot])
                continue
            if claim.reason == "held":
                self.watch(slot.job, slot.slot_ms, now_ms, again=True)
                continue
            self._forget(slot)
            if claim.won:
                self._metrics.superseded(slot.job.name)
                logger.warning(
                    "anarchon: took %s @ %s over from an owner whose lease ended (token %s)",
                    slot.job.name,
                    _iso(slot.slot_ms),
                    claim.token,
                )
                slot.claim = claim
                self._publisher.send(slot, claimed_at)

    def _retry(self, slots: Sequence[Slot]) -> None:
        """The backend did not answer these checks: check them again when it
        is retried (past ``max_late`` by then, they are recorded instead)."""
        retry_ms = self._link.retry_ms()
        for slot in slots:
            self._agenda.push(retry_ms, slot)

    def _take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim] | None:
        """:meth:`LeaseBackend.take_over_many`, or None (logged) without a
        full answer; every request ``taken`` on a claim-only backend (it
        never takes over)."""
        backend = self._link.lease_backend
        if backend is None:
            return [Claim(r.job, r.slot_ms, won=False, reason="taken") for r in requests]
        try:
            claims = backend.take_over_many(requests)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            return None
        except Exception:
            logger.exception("anarchon: take-over of %d slot(s) failed", len(requests))
            return None
        if len(claims) != len(requests):
            logger.error(
                "anarchon: backend answered %d of %d take-overs", len(claims), len(requests)
            )
            return None
        return claims

    def _record_lost(self, due: Sequence[Slot], now_ms: int) -> None:
        """Slots past ``max_late`` that this instance backs up: one still
        ``claimed`` whose lease ended (its holder died before recording a
        send, maybe after publishing) is taken over (fenced, with a claim
        window reaching back to it) and recorded ``lost``, never sent; so
        the slot is on the record, and no later claim can take it. One whose
        holder's lease still runs is checked again at its end; the others
        (sent, recorded) are forgotten."""
        if not self._link.ready:
            self._retry(due)
            return
        max_skew = self._settings.max_skew
        requests = [s.job.catch_up_request(s.slot_ms, now_ms, max_skew) for s in due]
        claims = self._take_over_many(requests)
        if claims is None:
            self._retry(due)
            return
        for slot, claim in zip(due, claims, strict=True):
            job = slot.job
            if claim.reason in ("unknown", "deadline"):
                self._retry([slot])
                continue
            if claim.reason == "held":
                retry_ms = now_ms + _ms(job.options.lease_ttl) + TAKE_OVER_GRAIN_MS
                self._agenda.push(retry_ms, slot)
                continue
            self._forget(slot)
            if not claim.won:
                continue
            error = "its owner's lease ended before it recorded a send; past max_late"
            if self._journal.mark(claim, State.LOST, error=error):
                self._metrics.missed(job.name, 1)
                logger.warning(
                    "anarchon: recorded %s @ %s lost: its owner's lease ended before it "
                    "recorded a send, and max_late=%ss has passed (token %s)",
                    job.name,
                    _iso(slot.slot_ms),
                    job.options.max_late,
                    claim.token,
                )
