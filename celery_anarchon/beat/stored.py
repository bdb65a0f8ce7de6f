"""Stored jobs on the beat side: reading the backend's changes each tick and
applying them to the jobs and the agenda (docs/runtime-schedules.md).

:class:`StoredJobs` owns what this instance knows of the stored jobs and
pause states (a :class:`~celery_anarchon.stored.StoredState` and its
version). Each tick reads the change counter (one ``GET`` or one
primary-key ``SELECT``) and, when it moved, only the records written since.

The rules it applies, the same on every instance because they depend on the
records alone (their commit times are the backend's):

* a stored job's slots start at its effective time, 1 s after its commit
  (:data:`~celery_anarchon.stored.APPLY_DELAY_MS`); the definition it
  replaces keeps its slots before that instant and none after;
* a paused job's slots inside the pause are neither claimed nor sent; the
  first one is recorded ``skipped`` with the note (once per pause: every
  instance records the same slot, if absent);
* a name in this instance's ``beat_schedule`` is a code entry here: a
  stored job of that name is not run on this host (logged once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any
from zoneinfo import ZoneInfo

from ..backends.base import State
from ..backends.store import JOB, StoredJobsStore, StoredRecord
from ..exceptions import BackendUnavailable, ConfigurationError
from ..metrics import Metrics
from ..model import Job, job_from_stored, jobs_from_stored
from ..settings import Settings
from ..slots import first_slot
from ..stored import APPLY_DELAY_MS, Definition, Pause, StoredJob, StoredState
from ..times import iso
from ..times import ms as _ms
from .agenda import CATCH_UP, DUE, Agenda, Slot
from .journal import Journal
from .link import BackendLink

__all__ = ["POLL_INTERVAL", "StoredJobs"]

#: Most changes of one batch logged one by one (more: the batch's line only).
LOGGED_CHANGES = 20

#: States of a record that was a won claim (a run that counts).
RUN_STATES = frozenset(
    {State.CLAIMED, State.SENT, State.RUNNING, State.SUCCEEDED, State.FAILED, State.LOST}
)

logger = logging.getLogger(__name__)

#: Longest beat sleeps between two reads of the change counter on a backend
#: that keeps stored jobs, seconds: a change committed at any instant is
#: applied within this, plus one read, plus the tick that is running.
POLL_INTERVAL = 0.5


class StoredJobs:
    """The stored jobs and pause states this instance applies.

    Args:
        app: the Celery app (stored jobs are validated against it).
        settings: the settings.
        zone: the app's zone.
        jobs: the jobs this instance runs, by name (shared with the agenda
            and the registry): stored jobs join and leave it here.
        link: the backend.
        agenda: where the slots of changed jobs are planned.
        journal: where pauses are recorded.
        metrics: counters.
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        app: Any,
        settings: Settings,
        zone: ZoneInfo,
        jobs: MutableMapping[str, Job],
        link: BackendLink,
        agenda: Agenda,
        journal: Journal,
        metrics: Metrics,
        clock: Callable[[], float],
    ) -> None:
        self._app = app
        self._settings = settings
        self._zone = zone
        self._jobs = jobs
        self._link = link
        self._agenda = agenda
        self._journal = journal
        self._metrics = metrics
        self._clock = clock
        self.state = StoredState()
        #: True once every stored record was read (at start-up, or once the
        #: backend answered after it)
        self.loaded = False
        #: the code entries of this instance, by name
        self.code = {name for name, job in jobs.items() if job.source == "code"}
        #: (name, paused_ms) of pauses whose skip is recorded
        self._recorded: set[tuple[str, int]] = set()
        #: when the change counter was last read (monotonic seconds)
        self._read_at = 0.0
        #: (name, version) of stored jobs already warned about
        self._warned: set[tuple[str, int]] = set()

    @property
    def enabled(self) -> bool:
        """True when the backend keeps stored jobs (every lease backend)."""
        return isinstance(self._link.backend, StoredJobsStore)

    def _store(self) -> StoredJobsStore:
        backend = self._link.backend
        assert isinstance(backend, StoredJobsStore)
        return backend

    # -- reading ------------------------------------------------------------------

    def load(self) -> None:
        """Read every stored job and pause state at start-up and add them to
        the jobs, before their first slots are planned.

        A backend away at start-up is read when it answers
        (:meth:`refresh`): the stored jobs then start like jobs added at
        that moment, their catch-up gap settled as at start-up.
        """
        if not self.enabled:
            return
        if not self._link.ready:  # beat runs on; read once the backend answers
            return
        try:
            records = self._store().stored_changes(0)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            return
        self.loaded = True
        self.state.apply(records)
        runnable = [s for name, s in self.state.jobs.items() if name not in self.code]
        built, errors = jobs_from_stored(runnable, self._app, self._settings, self._zone)
        for name in sorted(self.state.jobs):
            if name in self.code or name in errors:
                self._build(name)  # warns once, naming the collision or the error
            else:
                built[name].pause = self.state.pauses.get(name)
                self._jobs[name] = built[name]
        for name, pause in self.state.pauses.items():
            job = self._jobs.get(name)
            if job is not None:
                job.pause = pause
        self._log_unreadable()
        if self.state.jobs or self.state.pauses:
            logger.info(
                "anarchon: %d stored job(s), %d paused job(s), version %d",
                len(self.state.jobs),
                sum(p.paused for p in self.state.pauses.values()),
                self.state.version,
            )

    def refresh_if_stale(self) -> None:
        """:meth:`refresh` when the last read is older than
        :data:`POLL_INTERVAL` (between the rounds of a busy tick)."""
        if time.monotonic() - self._read_at >= POLL_INTERVAL:
            self.refresh()

    def refresh(self) -> None:
        """Read the change counter; when it moved, apply what changed since
        the last read. A backend that does not answer is retried at the
        next tick (the definitions in force stay in force)."""
        if not self.enabled or not self._link.ready:
            return
        if not self.loaded:
            self._load_late()
            return
        store = self._store()
        self._read_at = time.monotonic()
        try:
            version = store.stored_version()
            if version == self.state.version:
                return
            if version < self.state.version:
                self._reload(store.stored_changes(0), version)
                return
            records = store.stored_changes(self.state.version)
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            return
        self.apply(records)

    def _reload(self, records: list[StoredRecord], version: int) -> None:
        """The change counter went back (a failover to a replica that missed
        writes, a Redis restarted without persistence): later writes reuse
        versions this instance has seen, so every record is read again and
        what differs from what it runs is applied as a change now."""
        logger.warning(
            "anarchon: the stored-jobs version went back from %d to %d (a failover, or a "
            "backend restarted without its data?): reading every stored job again",
            self.state.version,
            version,
        )
        now_ms = int(self._clock() * 1000)
        old, self.state = self.state, StoredState()
        self.state.apply(records)
        for name in sorted(set(old.jobs) | set(self.state.jobs)):
            was, now = old.jobs.get(name), self.state.jobs.get(name)
            if was is not None and now is not None and was.definition == now.definition:
                continue
            if now is None:
                change = StoredRecord(JOB, name, None, self.state.version, now_ms)
            else:
                change = StoredRecord(
                    JOB, name, now.definition.body(), now.version, now.committed_ms
                )
            current = self._jobs.get(name)
            if current is not None and current.source == "stored":
                current.version = -1  # every write of the new numbering is newer
            self._apply_job(change, now_ms)
        for name in set(old.pauses) | set(self.state.pauses):
            job = self._jobs.get(name)
            if job is not None:
                job.pause = self.state.pauses.get(name)

    def apply(self, records: list[StoredRecord]) -> None:
        """Apply ``records`` (oldest first) to the jobs and the agenda."""
        now_ms = int(self._clock() * 1000)
        before = self.state.version
        fresh = [r for r in records if r.version > before]
        self.state.apply(fresh)
        newest = {(r.kind, r.name): r.version for r in fresh}
        for record in fresh:
            # Every definition of a job holds until the next one does, also
            # when several are read at once; of its pause states, the newest.
            if record.kind != JOB and record.version != newest[record.kind, record.name]:
                continue
            if len(fresh) <= LOGGED_CHANGES:
                # A definition's number is the job's own version, as the
                # commands print it; a pause state's or a removal's is only
                # its place in the store's change counter.
                which = (
                    "version" if record.kind == JOB and record.body is not None else "store version"
                )
                logger.info("anarchon: %s (%s %d)", _change_text(record), which, record.version)
            if record.kind == JOB:
                self._apply_job(record, now_ms)
            else:
                self._apply_pause(record.name, now_ms)
        self._log_unreadable()
        if fresh:
            last = fresh[-1]
            logger.info(
                "anarchon: applied stored-jobs version %d (%d change(s), committed %s, %.3f s ago)",
                last.version,
                len(fresh),
                iso(last.committed_ms, exact=True),
                (now_ms - last.committed_ms) / 1000.0,
            )

    def _load_late(self) -> None:
        """:meth:`load`, once the backend answers after a start-up without
        it: the stored jobs join the agenda now, and their gap is settled
        with the code entries' (:meth:`Agenda.settle_gaps`)."""
        before = set(self._jobs)
        self.load()
        if not self.loaded:
            return
        now_ms = int(self._clock() * 1000)
        for name, job in self._jobs.items():
            if name in before:
                continue
            job.next_slot_ms = first_slot(job.slots, now_ms, _ms(job.options.max_late))
            self._agenda.push_next(job)
            if job.next_slot_ms is not None:
                self._agenda.unsettled[name] = job.next_slot_ms

    # -- applying -----------------------------------------------------------------

    def _build(self, name: str, stored: StoredJob | None = None) -> Job | None:
        """The job of a stored definition (default: the newest, in the
        state), or None: a code entry here has the name, or this instance
        cannot build it (logged once per version)."""
        stored = stored or self.state.jobs[name]
        if name in self.code:
            self._warn_once(
                name,
                stored.version,
                "anarchon: job %s is both a beat_schedule entry here and a stored job "
                "(version %d): the code entry wins on this host; rename or remove one",
                name,
                stored.version,
            )
            return None
        try:
            job = job_from_stored(stored, self._app, self._settings, self._zone)
        except ConfigurationError as exc:
            self._warn_once(
                name,
                stored.version,
                "anarchon: stored job %s (version %d) cannot run on this host: %s",
                name,
                stored.version,
                exc,
            )
            return None
        job.pause = self.state.pauses.get(name)
        return job

    def _apply_job(self, record: StoredRecord, now_ms: int) -> None:
        name = record.name
        current = self._jobs.get(name)
        if current is not None and current.source == "code":
            if record.body is not None:
                self._build(name)  # warns of the collision
            return
        effective_ms = record.committed_ms + APPLY_DELAY_MS
        if current is not None:
            # Writes between the one it came from and this one (read at once)
            # retire it at the first of them.
            effective_ms = record.first_change_after(current.version) + APPLY_DELAY_MS
            # Its slots before the change's effective time stay (one
            # definition or the other sends them, once); none after.
            if current.retired_ms is None or current.retired_ms > effective_ms:
                current.retired_ms = effective_ms
            del self._jobs[name]
        if record.body is None:
            return
        try:
            definition = Definition.from_body(name, record.body)
        except ConfigurationError:
            return  # the state named it unreadable, logged once
        job = self._build(name, StoredJob(definition, record.version, record.committed_ms))
        if job is None:
            return
        self._jobs[name] = job
        job.next_slot_ms = first_slot(job.slots, now_ms, _ms(job.options.max_late))
        self._agenda.push_next(job)

    def _apply_pause(self, name: str, now_ms: int) -> None:
        pause = self.state.pauses.get(name)
        job = self._jobs.get(name)
        if job is None:
            return
        previous, job.pause = job.pause, pause
        if (
            pause is not None
            and not pause.paused
            and previous is not None
            and previous.paused
            and job.options.catch_up != "none"
        ):
            self._catch_up_pause(job, pause, now_ms)

    def _catch_up_pause(self, job: Job, pause: Pause, now_ms: int) -> None:
        """On resume, send the slots the pause held back as the job's
        ``catch_up`` policy asks (``latest``: the newest; ``all``: the newest
        ``catch_up_limit``, oldest first), inside ``catch_up_window``: the
        pause's slots up to the instant the resume holds, each claimed as a
        catch-up claim (once across instances), a slot not yet due when
        it falls due."""
        o = job.options
        until = pause.until_ms or now_ms
        start = max(pause.from_ms, now_ms - _ms(o.catch_up_window))
        held: list[int] = []
        slot = job.slots.next_after(start - 1)
        while slot is not None and slot < until:  # a slot after now is sent when due
            held.append(slot)
            if len(held) > 2 * o.catch_up_limit:
                del held[: o.catch_up_limit]
            slot = job.slots.next_after(slot)
        send = held[-1:] if o.catch_up == "latest" else held[-o.catch_up_limit :]
        for slot_ms in send:
            self._agenda.push(slot_ms, Slot(job, slot_ms, CATCH_UP))
        if send:
            logger.info(
                "anarchon: %s resumed: catching up %d paused slot(s) (catch_up=%r)",
                job.name,
                len(send),
                o.catch_up,
            )

    # -- the tick's questions -----------------------------------------------------

    def held_back(self, slot: Slot) -> bool:
        """Whether ``slot`` (a ``DUE``, ``CLAIM`` or ``CATCH_UP``) must not be
        claimed: its definition was replaced or removed before it, or its
        job is paused at it (a ``DUE`` moves the job on; the pause is
        recorded once). A ``CATCH_UP`` inside a pause is the resume's
        catch-up (:meth:`_catch_up_pause`): it goes on."""
        job = slot.job
        if job.retired_at(slot.slot_ms):
            return True
        pause = job.pause
        if pause is None or slot.kind == CATCH_UP or not pause.covers(slot.slot_ms):
            return False
        if slot.kind == DUE:
            self._agenda.advance(job, slot.slot_ms)
        self._record_pause(job, pause)
        return True

    def finished(self, job: Job, slot_ms: int, reason: str) -> None:
        """``job`` is finished from ``slot_ms`` on (its run limit is reached,
        or its ``end_at`` passed): it claims nothing more, and its history
        records why once, at ``slot_ms`` (every instance records the same
        slot, if absent). Updating a stored job's bounds builds it anew."""
        if job.retired_ms is not None and job.retired_ms <= slot_ms:
            return
        job.retired_ms = slot_ms
        job.finished = reason
        job.next_slot_ms = None  # its planned slot is dropped
        written = self._journal.record_absent(
            [(job, slot_ms, State.SKIPPED, f"finished: {reason}")]
        )
        if any(written):
            logger.info("anarchon: %s has no slot left (%s): finished", job.name, reason)

    def limit_reached(self, job: Job, refused_ms: int) -> None:
        """The backend refused a claim of ``job`` at ``refused_ms``: its run
        limit is reached. Finished (:meth:`finished`), recorded at the slot
        after its last run, which every instance finds the same in the
        history (the refused slot itself differs between instances)."""
        if job.finished:
            return
        at = refused_ms
        backend = self._link.backend
        try:
            runs = backend.history(job.name, 50) if backend is not None else []
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            runs = []
        last = next((r.slot_ms for r in runs if r.state in RUN_STATES and not r.manual_key), None)
        if last is not None:
            at = job.slots.next_after(last) or refused_ms
        self.finished(job, min(at, refused_ms), f"max_runs={job.options.max_runs} reached")

    def ended(self, job: Job) -> None:
        """``job``'s ``end_at`` passed with no slot left: finished
        (:meth:`finished`, recorded 1 ms after ``end_at``, where no slot of
        the job can be: a slot at ``end_at`` itself is a real run)."""
        end_ms = job.options.end_at_ms
        if end_ms is not None:
            self.finished(job, end_ms + 1, f"end_at {iso(end_ms)} passed")

    def check_limits(self) -> None:
        """At start-up: jobs whose run limit the cluster already reached are
        finished before their first slot is claimed (no record: the limit's
        own claim recorded it)."""
        limited = [job for job in self._jobs.values() if job.options.max_runs is not None]
        backend = self._link.lease_backend
        if not limited or backend is None or not self._link.ready:
            return
        try:
            counts = backend.won_counts([job.name for job in limited])
        except BackendUnavailable as exc:
            self._link.on_outage(exc)
            return
        for job in limited:
            if counts.get(job.name, 0) >= (job.options.max_runs or 0):
                job.finished = f"max_runs={job.options.max_runs} reached"
                job.next_slot_ms = None
                job.retired_ms = 0

    def _record_pause(self, job: Job, pause: Pause) -> None:
        """Record the pause once in the job's history: ``skipped`` 1 ms after
        the first slot inside it, with the note (every instance picks the
        same instant, so the record is written once)."""
        key = (job.name, pause.paused_ms)
        if key in self._recorded:
            return
        first = job.slots.next_after(pause.from_ms - 1)
        if first is None:
            return
        # 1 ms after that slot, where no slot of the job can be (intervals
        # are at least 0.1 s): the slot itself stays free for a resume's
        # catch-up claim.
        first += 1
        note = f"; note: {pause.note}" if pause.note else ""
        error = f"paused since {iso(pause.paused_ms)}{note}; no slot runs until resumed"
        written = self._journal.record_absent([(job, first, State.SKIPPED, error)])
        self._recorded.add(key)
        if any(written):
            self._metrics.skipped(job.name)

    def _warn_once(self, name: str, version: int, message: str, *args: Any) -> None:
        if (name, version) not in self._warned:
            self._warned.add((name, version))
            logger.warning(message, *args)

    def _log_unreadable(self) -> None:
        for name, error in self.state.unreadable.items():
            self._warn_once(name, -1, "anarchon: stored job %s is unreadable: %s", name, error)


def _change_text(record: StoredRecord) -> str:
    """What a record changed, for the log: ``stored job sync written``."""
    if record.kind == JOB:
        return f"stored job {record.name} " + ("removed" if record.body is None else "written")
    if record.body is None:
        return f"pause state of {record.name} cleared"
    paused = '"paused":true' in record.body
    return f"job {record.name} " + ("paused" if paused else "resumed")
