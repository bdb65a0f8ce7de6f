"""Planning: what falls due when.

The :class:`Agenda` is one heap of events, each a :class:`Slot` due at an
instant: a job's next slot, a claim after this instance's claim delay, a
take-over check, a catch-up claim, the close of a send that failed. It plans
each job's first slot at start-up and settles the catch-up gap, the slots
that passed while no instance ran (docs/scheduling.md, "Start-up").
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..backends.base import Claim, State
from ..exceptions import BackendUnavailable
from ..metrics import Metrics
from ..model import Job
from ..slots import first_slot
from ..times import ms as _ms
from .link import BackendLink

__all__ = [
    "CATCH_UP",
    "CLAIM",
    "DUE",
    "MAX_MISSES_COUNTED",
    "MAX_MISSES_RECORDED",
    "SEND_FAILED",
    "TAKE_OVER",
    "Agenda",
    "Slot",
]

logger = logging.getLogger(__name__)

#: Kinds of events: a job's next slot is due; claim a slot after this
#: instance's claim delay; check whether a lost slot's owner died (backup
#: runner); claim a slot missed while every instance was down (catch-up);
#: record lost a claim whose send failed and that no backup took over.
DUE, CLAIM, TAKE_OVER, CATCH_UP, SEND_FAILED = 0, 1, 2, 3, 4

#: Most missed slots of one job recorded one by one after a long stall; the
#: rest are counted in the log line, up to MAX_MISSES_COUNTED, past which the
#: job skips ahead without counting (a stall of days for a 1 ms interval).
MAX_MISSES_RECORDED = 100
MAX_MISSES_COUNTED = 1_000_000

#: A job the backend has never seen starts at its first slot at or after
#: start-up less this, milliseconds: a slot that fell due while the process
#: was starting is still sent; none of the last ``max_late`` before it is.
NEW_JOB_GRACE_MS = 1000


@dataclass(slots=True, eq=False)
class Slot:
    """One slot of one job, from due to recorded.

    Attributes:
        job: the job.
        slot_ms: the slot's time, epoch ms.
        kind: what is due (:data:`DUE`, :data:`CLAIM`, :data:`TAKE_OVER`,
            :data:`CATCH_UP`, :data:`SEND_FAILED`).
        claim: this instance's claim, once it has one.
        seen: for a take-over check this instance makes only if a peer dies
            (a late rank): the peers it saw live when it lost the slot.
        error: why its send failed (a failed send waiting for a backup).
        lease_end_ms: the latest end of its lease, epoch ms (a failed send).
        task_id: its Celery task id, once published.
        mark_until_ms: until when recording it ``sent`` is retried, epoch ms.
    """

    job: Job
    slot_ms: int
    kind: int
    claim: Claim | None = None
    seen: list[str] | None = None
    error: str = ""
    lease_end_ms: int = 0
    task_id: str = ""
    mark_until_ms: int = 0

    @property
    def key(self) -> tuple[str, int]:
        """``(job name, slot ms)``: the slot's identity across instances."""
        return self.job.name, self.slot_ms

    @property
    def catch_up(self) -> bool:
        """True for a slot claimed late on purpose (catch-up)."""
        return self.kind == CATCH_UP


class Agenda:
    """The event heap and the first slots.

    Args:
        jobs: the jobs, by name.
        link: the backend (read for the catch-up gap).
        record_absent: records ``(job, slot, state, error)`` where a slot has
            none, answering whether each was written
            (:meth:`Journal.record_absent`): the gap's missed slots.
        metrics: counters.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        jobs: Mapping[str, Job],
        link: BackendLink,
        record_absent: Callable[[Sequence[tuple[Job, int, State, str]]], list[bool]],
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._jobs = jobs
        self._link = link
        self._record_absent = record_absent
        self._metrics = metrics
        self._clock = clock
        #: heap of (due ms, sequence, slot)
        self._events: list[tuple[int, int, Slot]] = []
        self._seq = 0
        #: job -> first slot planned at start-up, while its gap is not settled
        self.unsettled: dict[str, int] = {}
        #: when the first slots were planned, epoch ms
        self._started_ms = 0
        #: called when a job with an ``end_at`` has no slot left (the
        #: scheduler records it finished)
        self.on_end: Callable[[Job], None] = lambda job: None

    # -- the heap ----------------------------------------------------------

    def push(self, due_ms: int, slot: Slot) -> None:
        """Plan ``slot`` (its ``kind`` says what is due) at ``due_ms``."""
        self._seq += 1
        heapq.heappush(self._events, (due_ms, self._seq, slot))

    def again(self, due_ms: int, slot: Slot) -> None:
        """Plan ``slot``'s claim again at ``due_ms``: a catch-up claim stays
        one, any other becomes a :data:`CLAIM`."""
        if slot.kind != CATCH_UP:
            slot.kind = CLAIM
        self.push(due_ms, slot)

    def push_next(self, job: Job) -> None:
        """Plan ``job``'s next slot: a :data:`DUE` event at the slot itself.
        The claim then happens at once or after this instance's claim delay
        (:meth:`Registry.claim_delay_ms`), scheduled here, never slept."""
        if job.next_slot_ms is not None:
            self.push(job.next_slot_ms, Slot(job, job.next_slot_ms, DUE))

    def pop_due(self, now_ms: int, most: int | None = None) -> list[Slot]:
        """The events due by ``now_ms``, in order, at most ``most`` of them
        (None: all); the rest stay planned, in order. A stale ``DUE`` (the
        job moved on) is dropped."""
        due: list[Slot] = []
        while self._events and self._events[0][0] <= now_ms:
            if most is not None and len(due) >= most:
                break
            slot = heapq.heappop(self._events)[2]
            if slot.kind == DUE and slot.job.next_slot_ms != slot.slot_ms:
                continue
            due.append(slot)
        return due

    def next_due_ms(self) -> int | None:
        """When the next event falls due, epoch ms, or None."""
        return self._events[0][0] if self._events else None

    def advance(self, job: Job, slot_ms: int) -> None:
        """Move ``job`` past ``slot_ms`` and plan its next slot."""
        job.next_slot_ms = job.slots.next_after(slot_ms)
        if job.next_slot_ms is None and job.options.end_at_ms is not None:
            self.on_end(job)
        self.push_next(job)

    def skip_missed(self, job: Job, slot_ms: int, now_ms: int) -> tuple[Job, list[int], int]:
        """Move ``job`` past ``slot_ms`` and every later slot already past
        ``max_late``, plan its next slot, and answer ``(job, slots, total)``
        for :meth:`Journal.record_misses`: the newest
        :data:`MAX_MISSES_RECORDED` missed slots, to be recorded one by one,
        and how many were missed (counted up to :data:`MAX_MISSES_COUNTED`)."""
        late_ms = _ms(job.options.max_late)
        newest: collections.deque[int] = collections.deque(maxlen=MAX_MISSES_RECORDED)
        total = 0
        slot: int | None = slot_ms
        while slot is not None and now_ms > job.deadline_ms(slot) and total < MAX_MISSES_COUNTED:
            newest.append(slot)
            total += 1
            slot = job.slots.next_after(slot)
        while slot is not None and now_ms > job.deadline_ms(slot):  # beyond the count
            slot = job.slots.next_after(max(slot, now_ms - late_ms))
        job.next_slot_ms = slot
        if slot is None and job.options.end_at_ms is not None:
            self.on_end(job)
        self.push_next(job)
        return job, list(newest), total

    # -- first slots and the catch-up gap -----------------------------------

    def plan_first_slots(self) -> None:
        """Plan each job's first slot: the first after ``now - max_late``
        (docs/scheduling.md, "Start-up"; moved to start-up for a job the
        backend never saw, :meth:`_start_new_job`), and settle what happened while no instance
        ran (:meth:`settle_gaps`): now, or once the backend answers when it
        is away at start-up."""
        now_ms = self._started_ms = int(self._clock() * 1000)
        events = []
        for job in self._jobs.values():
            job.next_slot_ms = first = first_slot(job.slots, now_ms, _ms(job.options.max_late))
            if first is not None:
                self._seq += 1
                events.append((first, self._seq, Slot(job, first, DUE)))
        heapq.heapify(events)  # one O(n) build, not n pushes (100,000 jobs)
        self._events = events
        self.unsettled = {
            name: job.next_slot_ms
            for name, job in self._jobs.items()
            if job.next_slot_ms is not None
        }
        if self._link.ready:
            self.settle_gaps()

    def settle_gaps(self) -> None:
        """Settle each job's gap between the backend's last record of it and
        its first slot planned at start-up (:meth:`_settle_gap`), once.
        Called at start-up and, while that has not happened (the backend was
        away), as soon as the backend answers, before anything this
        instance records itself: the slots of the gap were never acted on
        by anybody and must still be recorded missed or caught up.

        A job the backend has no record of (a lease backend; a first
        deploy) has no gap and never ran: its first slot moves forward to
        the first at or after start-up (:meth:`_start_new_job`)."""
        if not self.unsettled:
            return
        last_slots = self._last_slots()
        if not self._link.ready:  # the read failed: again at the next answer
            return
        pending, self.unsettled = self.unsettled, {}
        now_ms = int(self._clock() * 1000)
        for name, first_ms in pending.items():
            job = self._jobs.get(name)
            last = last_slots.get(name)
            if job is not None and last is not None:
                self._settle_gap(job, last, first_ms, now_ms)
            elif job is not None and self._link.leases:
                self._start_new_job(job, first_ms)

    def _start_new_job(self, job: Job, first_ms: int) -> None:
        """Plan a job the backend has never seen from its first slot at or
        after start-up less :data:`NEW_JOB_GRACE_MS`, instead of the first
        of the last ``max_late`` (docs/scheduling.md, "Start-up"): those
        slots passed before the job existed anywhere. Left alone once the
        job moved past its first slot (the backend answered late)."""
        if job.next_slot_ms != first_ms:
            return
        start = first_slot(job.slots, self._started_ms, NEW_JOB_GRACE_MS + 1)
        if start is not None and start > first_ms:
            job.next_slot_ms = start
            self.push_next(job)  # the DUE planned for first_ms is now stale

    def _last_slots(self) -> dict[str, int]:
        """``job -> newest scheduled slot the backend has a record of``
        (lease backends; claim-only backends keep no such record)."""
        if not self._link.leases:
            return {}
        assert self._link.backend is not None
        try:
            return self._link.backend.last_slots(list(self._jobs))  # one pipeline or query
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
        return {}

    def _settle_gap(self, job: Job, last_ms: int, first_ms: int, now_ms: int) -> None:
        """Slots after the backend's last record of ``job`` and before its
        first slot now were never acted on: every instance was down. Inside
        ``catch_up_window`` they are sent or recorded ``missed`` by the
        job's catch-up policy (docs/scheduling.md, "Start-up"):

        * ``none``: each is recorded ``missed`` (the newest ``history_size``);
        * ``latest``: the newest is sent once, unless the first slot now is
          already due (a newer run is being sent anyway); the rest missed;
        * ``all``: the newest ``catch_up_limit`` are sent, oldest first; the
          older rest missed.
        """
        o = job.options
        window_start = now_ms - _ms(o.catch_up_window)
        gap: list[int] = []
        slot = job.slots.next_after(max(last_ms, window_start - 1))
        bound = max(o.history_size, o.catch_up_limit)
        pause = job.pause
        while slot is not None and slot < first_ms:
            if pause is None or not pause.covers(slot):  # a paused slot was never due
                gap.append(slot)
            if len(gap) > 2 * bound:  # keep the newest only; bounded memory
                del gap[:bound]
            slot = job.slots.next_after(slot)
        if not gap:
            return
        send: list[int] = []
        if o.catch_up == "latest" and first_ms > now_ms:
            send = gap[-1:]
        elif o.catch_up == "all":
            send = gap[-o.catch_up_limit :]
        missed = [s for s in gap if s not in send][-o.history_size :]
        recorded = sum(
            self._record_absent(
                [(job, s, State.MISSED, "no instance ran (catch_up)") for s in missed]
            )
        )
        if recorded:
            self._metrics.missed(job.name, recorded)
            logger.warning(
                "anarchon: %d slot(s) of %s passed while no instance ran; recorded "
                "as missed (catch_up=%r)",
                recorded,
                job.name,
                o.catch_up,
            )
        for s in send:
            self.push(s, Slot(job, s, CATCH_UP))  # oldest first, before the rest
