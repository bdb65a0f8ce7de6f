"""Recording: what happened to each slot, written behind the send path.

The :class:`Journal` writes ``sent`` marks in chunks (a send never waits
for more than :data:`MARK_DELAY` seconds of them), ``missed`` and
``skipped`` records where a slot has none, and single fenced marks
(``lost``). What the backend could not take while it was away waits in
bounded queues and is written once it answers.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..backends.base import AbsentRecord, Claim, State
from ..exceptions import BackendUnavailable
from ..metrics import Metrics
from ..model import Job
from ..settings import Settings
from ..times import iso as _iso
from ..times import ms as _ms
from .link import BackendLink

if TYPE_CHECKING:
    from .agenda import Slot

__all__ = ["Journal", "MARK_CHUNK", "MARK_DELAY", "RECORD_CHUNK"]

logger = logging.getLogger(__name__)

#: Most records queued while the backend is away (the newest are kept).
MAX_UNRECORDED = 100_000
#: ``missed``/``skipped`` records written per backend call
#: (:meth:`Backend.record_many_if_absent`).
RECORD_CHUNK = 500

#: Sent slots recorded ``sent`` in one backend call (``Backend.mark_many``),
#: and the longest a send waits for its chunk to be recorded, seconds.
MARK_CHUNK = 200
MARK_DELAY = 0.1

#: Most sent slots kept for recording while the backend is away (the newest
#: are kept).
MAX_UNMARKED = 100_000

#: Longest the records queued during an outage are written in one tick, seconds.
UNRECORDED_BUDGET = 0.5

#: A record to write where the slot has none: (job, slot ms, state, error).
Absent = tuple[Job, int, State, str]


class Journal:
    """Write-behind of the records of slots.

    Args:
        link: the backend.
        settings: the settings (``max_skew``, for how long records are kept).
        metrics: counters and call timings.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        link: BackendLink,
        settings: Settings,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._link = link
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        #: records to write once the backend answers (the newest kept)
        self.unrecorded: collections.deque[Absent] = collections.deque(maxlen=MAX_UNRECORDED)
        #: published slots not yet recorded ``sent``, oldest first
        self.unmarked: list[Slot] = []
        #: when the oldest of them was queued (time.monotonic())
        self._unmarked_since = 0.0

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # -- single fenced marks -------------------------------------------------

    def mark(self, claim: Claim, state: State, **fields: Any) -> bool:
        """Record ``state`` for ``claim`` (one call); True when written,
        False when refused (fenced) or not written (the backend did not
        answer: logged, and an outage begins)."""
        backend = self._link.backend
        if backend is None:
            return False
        started = time.perf_counter()
        try:
            done = backend.mark(claim, state, **fields)
        except BackendUnavailable as exc:
            self._metrics.backend_error("mark")
            self._link.on_outage(exc)
        except Exception:
            logger.exception("anarchon: recording %s for %s failed", state, claim.job)
        else:
            self._metrics.backend_call("mark", time.perf_counter() - started)
            return done
        return False

    # -- sent, in chunks ------------------------------------------------------

    def record_sent(self, slot: Slot) -> None:
        """Queue ``sent`` for a slot just published (its ``claim`` and
        ``task_id`` set); the queue goes to the backend in chunks
        (:meth:`flush_marks`) of :data:`MARK_CHUNK`, or once its oldest
        waited :data:`MARK_DELAY` seconds, and at the end of every batch.
        Until recorded, a mark is retried (a backend blip must not leave the
        slot ``claimed``, for a backup to take over and publish again) while
        a backup could still take the slot over: until the lease or the
        slot's claim window ends, whichever is later."""
        job = slot.job
        window_end = job.window_end_ms(slot.slot_ms, self._settings.max_skew)
        slot.mark_until_ms = max(window_end, self._now_ms() + _ms(job.options.lease_ttl))
        if not self.unmarked:
            self._unmarked_since = time.monotonic()
        self.unmarked.append(slot)
        if len(self.unmarked) > MAX_UNMARKED:
            dropped = self.unmarked[:-MAX_UNMARKED]
            del self.unmarked[:-MAX_UNMARKED]
            self._warn_unmarked(dropped, "too many were waiting")
        ready = self._link.ready and len(self.unmarked) >= MARK_CHUNK
        if ready or time.monotonic() - self._unmarked_since >= MARK_DELAY:
            self.flush_marks()

    def flush_marks(self) -> None:
        """Record ``sent`` for the queued slots, :data:`MARK_CHUNK` per
        :meth:`Backend.mark_many` call. On an outage the rest stays queued
        and is retried at later ticks; a mark whose retry time passed is
        dropped with a warning. A refused mark (the slot was taken over
        meanwhile) is logged."""
        now_ms = self._now_ms()
        expired = [s for s in self.unmarked if s.mark_until_ms < now_ms]
        if expired:
            self.unmarked = [s for s in self.unmarked if s.mark_until_ms >= now_ms]
            self._warn_unmarked(expired, "the backend did not answer in time")
        backend = self._link.backend
        while self.unmarked and backend is not None and self._link.ready:
            chunk = self.unmarked[:MARK_CHUNK]
            started = time.perf_counter()
            try:
                answers = backend.mark_many(
                    [s.claim for s in chunk if s.claim is not None],
                    State.SENT,
                    task_ids=[s.task_id for s in chunk],
                )
            except BackendUnavailable as exc:
                self._metrics.backend_error("mark")
                self._link.on_outage(exc)
                break
            except Exception:  # a bug, not an outage: logged, not retried
                logger.exception("anarchon: recording %d sent slot(s) failed", len(chunk))
                answers = [True] * len(chunk)
            else:
                self._metrics.backend_call("mark", time.perf_counter() - started)
            del self.unmarked[: len(chunk)]
            for slot, done in zip(chunk, answers, strict=False):
                if not done:
                    logger.warning(
                        "anarchon: %s @ %s was taken over by another instance while this "
                        "one sent it; the worker integration discards the second delivery",
                        slot.job.name,
                        _iso(slot.slot_ms),
                    )
        self._unmarked_since = time.monotonic()

    def _warn_unmarked(self, slots: Sequence[Slot], why: str) -> None:
        logger.warning(
            "anarchon: %d sent slot(s) could not be recorded sent (%s), first %s @ %s; "
            "a backup instance may send them again",
            len(slots),
            why,
            slots[0].job.name,
            _iso(slots[0].slot_ms),
        )

    # -- missed and skipped ---------------------------------------------------

    def record_misses(self, misses: Sequence[tuple[Job, list[int], int]]) -> None:
        """Write ``missed`` for each ``(job, slots, total)`` (the newest
        ``history_size`` slots of each job) in batched backend calls, and log
        one warning per job counting its ``total`` missed slots. A job may
        come more than once (a late claim of one slot and its next slot's
        late ``DUE``): its entries are merged first, so each slot counts
        once in the metric and the warning."""
        merged: dict[str, tuple[Job, list[int], int]] = {}
        for job, slots, total in misses:
            _, seen, counted = merged.get(job.name, (job, [], 0))
            merged[job.name] = (job, sorted({*seen, *slots}), counted + total)
        misses = list(merged.values())
        records = [
            (job, slot, State.MISSED, "later than max_late")
            for job, slots, _ in misses
            for slot in slots[-job.options.history_size :]
        ]
        answers = self.record_absent(records)
        written = collections.Counter(
            job.name for (job, _, _, _), ok in zip(records, answers, strict=True) if ok
        )
        for job, slots, total in misses:
            recorded = written[job.name]
            if not recorded:
                continue
            self._metrics.missed(job.name, recorded)
            unrecorded = total - len(slots[-job.options.history_size :])
            logger.warning(
                "anarchon: missed %d slot(s) of %s (last %s): this instance was more "
                "than max_late=%ss behind%s",
                recorded + unrecorded,
                job.name,
                _iso(slots[-1]),
                job.options.max_late,
                f"; {unrecorded} older ones not recorded one by one" if unrecorded else "",
            )

    def record_if_absent(self, job: Job, slot_ms: int, state: State, error: str) -> bool:
        """Record ``state`` for one slot with no record (see
        :meth:`record_absent`); whether it was written."""
        return self.record_absent([(job, slot_ms, state, error)])[0]

    def record_absent(self, records: Sequence[Absent]) -> list[bool]:
        """Record ``(job, slot, state, error)`` where each slot has no record
        (``missed``, ``skipped``), :data:`RECORD_CHUNK` per backend call;
        whether each was written. While the backend is away, the rest wait
        in a queue (the newest :data:`MAX_UNRECORDED`) and are written when
        it is back (:meth:`record_after_outage`)."""
        answers = [False] * len(records)
        for start in range(0, len(records), RECORD_CHUNK):
            chunk = records[start : start + RECORD_CHUNK]
            backend = self._link.backend
            if not self._link.ready or backend is None:
                self.unrecorded.extend(chunk)
                continue
            try:
                written = backend.record_many_if_absent(
                    [
                        AbsentRecord(
                            job.name,
                            slot_ms,
                            state,
                            error,
                            history_size=job.options.history_size,
                            history_ttl_ms=_ms(job.options.history_ttl),
                            keep_until_ms=job.keep_until_ms(slot_ms, self._settings.max_skew),
                        )
                        for job, slot_ms, state, error in chunk
                    ]
                )
            except BackendUnavailable as exc:
                self._link.on_outage(exc)
                self.unrecorded.extend(chunk)
                continue
            except Exception:
                logger.exception(
                    "anarchon: recording %d slot(s) %s failed, first %s",
                    len(chunk),
                    chunk[0][2],
                    chunk[0][0].name,
                )
                continue
            answers[start : start + len(chunk)] = written
        return answers

    def record_after_outage(self) -> None:
        """Write the records that could not be written while the backend was
        away (oldest first; the queue keeps the newest MAX_UNRECORDED), for
        at most :data:`UNRECORDED_BUDGET` seconds a tick."""
        pending = list(self.unrecorded)
        self.unrecorded = collections.deque(maxlen=MAX_UNRECORDED)
        recorded = 0
        deadline = time.monotonic() + UNRECORDED_BUDGET
        for start in range(0, len(pending), RECORD_CHUNK):
            if time.monotonic() > deadline or not self._link.ready:
                # The rest in later ticks (or, away again, when it is back).
                self.unrecorded.extend(pending[start:])
                break
            recorded += sum(self.record_absent(pending[start : start + RECORD_CHUNK]))
        if recorded:
            logger.warning(
                "anarchon: recorded %d slot(s) missed while the backend was away", recorded
            )
