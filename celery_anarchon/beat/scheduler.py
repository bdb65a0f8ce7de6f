"""The Celery side: a beat ``Scheduler`` that claims every slot before sending.

Start it on every host::

    celery -A proj beat -S celery_anarchon.Scheduler

Each tick pops the due slots from the agenda (cost per due slot, not per
job), records the ones later than ``max_late`` as missed, claims the rest in
one batch on the shared backend, and sends only what this instance won,
through Celery's own ``apply_async`` path. Any doubt counts as lost: an
unclaimed slot is never sent (docs/exactly-once.md). The parts, and how a
slot flows through them, are drawn in docs/architecture.md.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

from celery import beat

from ..backends import backend_from_settings, scheme_of
from ..backends.base import Backend, InstanceInfo, LeaseBackend, State
from ..checks import args_problem, check_backend_supports, run_check
from ..delayed.beat import start_releaser
from ..exceptions import ConfigurationError
from ..message import bounded_connection
from ..metrics import Metrics, metrics_from_app
from ..model import Entry, Job, app_zone, build_jobs
from ..settings import Settings, started_by_beat
from ..times import iso as _iso
from .agenda import CATCH_UP, CLAIM, DUE, SEND_FAILED, TAKE_OVER, Agenda, Slot
from .claiming import MAX_CLAIM_BATCH, Claimer
from .journal import MARK_DELAY, Journal
from .link import BackendLink
from .overlap import Overlap
from .publisher import Publisher
from .registry import (
    HEARTBEAT_INTERVAL,
    HOUSEKEEPING_BUDGET,
    Registry,
    new_instance_id,
    registry_ttl,
)
from .stored import POLL_INTERVAL, StoredJobs
from .takeover import TakeOver

__all__ = ["TICK_BUDGET", "Scheduler"]

logger = logging.getLogger(__name__)

#: Longest a tick keeps taking rounds of due slots before returning, seconds.
TICK_BUDGET = 1.0

#: Most due events one round takes from the agenda: enough for a full claim
#: batch when this instance is the preferred owner of a third of them (the
#: others come back after the claim delay). Taking every due event instead
#: pushed all but a batch back each round: at 100,000 due together, 50
#: rounds each moved up to 100,000 events through the heap, a quarter of
#: an instance's samples.
ROUND_EVENTS = 3 * MAX_CLAIM_BATCH

#: Events a pause or a replaced definition holds back (a slot already
#: claimed goes on to be sent or recorded).
HELD_KINDS = frozenset({DUE, CLAIM, CATCH_UP})


class Scheduler(beat.Scheduler):
    """Celery beat scheduler that claims each slot once across instances.

    Honours Celery's scheduler contract: constructing with ``lazy=True``
    connects nothing; :meth:`close` may run twice (beat calls it twice on
    SIGTERM); :meth:`tick` never raises into beat's loop because of a backend
    or broker error.

    The work is done by components built at set-up, each owning its state
    (docs/architecture.md): :attr:`link` (the backend), :attr:`agenda`,
    :attr:`claimer`, :attr:`publisher`, :attr:`journal`, :attr:`take_over`,
    :attr:`overlap`, :attr:`registry` and :attr:`stored` (stored jobs).

    Args:
        app: the Celery app.
        schedule_filename: beat's ``-s`` file; the default SQLite backend
            lives beside it.
        backend: a ready :class:`~celery_anarchon.backends.base.Backend`
            (tests); default: built from the settings.
        clock: a function returning the time in seconds since the epoch
            (tests); default :func:`time.time`.
    Raises:
        ConfigurationError: at start-up, on any bad setting or schedule.
    """

    Entry = Entry

    # The components, built by setup_schedule.
    agenda: Agenda
    stored: StoredJobs
    claimer: Claimer
    journal: Journal
    overlap: Overlap
    publisher: Publisher
    registry: Registry
    take_over: TakeOver

    def __init__(
        self,
        app: Any,
        *args: Any,
        schedule_filename: str | None = None,
        backend: Backend | None = None,
        clock: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> None:
        self.schedule_filename = schedule_filename
        self.instance_id = new_instance_id()
        self._clock = clock or time.time
        self.link = BackendLink(backend, self._clock)
        self._settings: Settings | None = None
        self._jobs: dict[str, Job] = {}
        #: True once setup_schedule built the components
        self._wired = False
        #: True once setup_schedule finished (start-up errors stop beat only before)
        self._setup_done = False
        self._closed = False
        self._ticking = False  # inside tick() (close() from a signal handler waits)
        self._close_requested = False
        self._random = random.Random()
        self.metrics: Metrics = Metrics()
        #: the releaser of parked tasks (docs/delayed-tasks.md), once set up
        self.releaser: Any = None
        super().__init__(app, *args, **kwargs)

    # -- set-up ------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read settings, validate every job, connect, and plan first slots.

        Raises:
            ConfigurationError: any bad setting, schedule or backend URL; the
                message lists every problem found (as ``celery anarchon
                check`` does), not only the first.
            SystemExit: the same, under ``celery beat``: each problem is
                logged on one CRITICAL line and beat exits with code 1,
                without a traceback.
        """
        try:
            self._set_up()
        except (ConfigurationError, TypeError) as exc:
            error = self._every_problem(exc)
        else:
            return
        if started_by_beat():
            # Each problem is on its CRITICAL line already; an error escaping
            # here would be logged with its traceback twice, the second copy
            # one log line per fragment (beat redirects standard error).
            logger.critical("anarchon: beat stopped: fix the configuration above and restart.")
            raise SystemExit(1)
        raise error

    def _every_problem(self, first: Exception) -> ConfigurationError:
        """One error naming every configuration problem, each also logged on
        one CRITICAL line, so a user fixes them all in one restart."""
        try:
            problems = [
                p["message"] for p in run_check(self.app, self.schedule_filename, False).problems
            ]
        except Exception:  # the collector itself failed: report the first
            problems = []
        if not problems:
            problems = [str(first)]
        for message in problems:
            logger.critical("anarchon: %s", message)
        return ConfigurationError(
            f"beat cannot start: {len(problems)} configuration problem(s):\n  - "
            + "\n  - ".join(problems)
        )

    def merge_inplace(self, b: Mapping[str, Any]) -> None:
        """Celery's merge of ``beat_schedule`` into the entries, with the
        clock read once for all of them.

        Celery's ``ScheduleEntry`` reads the app's clock for each entry given
        no ``last_run_at`` (about 13 µs each, 1.3 s at 100,000 jobs). The
        value is Celery's bookkeeping only: slots come from the schedule and
        the backend, never from ``last_run_at``.
        """
        now = self.app.now()
        merged = {}
        for key in b:
            fields = dict(b[key])  # as Celery's: a dict, a ScheduleEntry, pairs
            fields.setdefault("last_run_at", now)
            merged[key] = fields
        super().merge_inplace(merged)

    def _set_up(self) -> None:
        # The jobs live as long as the process. While they are built, the
        # cyclic garbage collector is off: its full passes over the growing
        # schedule took 1.9 s of a 4.7 s start-up at 100,000 jobs (11
        # passes), and a pass at the end finds about 60 objects of garbage,
        # not worth its 0.5 s. Then they are frozen out of it for good,
        # whose full passes would otherwise pause a tick (about 7 s at
        # 100,000 jobs on the benchmark machine).
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._set_up_jobs()
        finally:
            if collecting:
                gc.enable()
        gc.freeze()

    def _set_up_jobs(self) -> None:
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        settings = Settings.from_app(self.app, schedule_filename=self.schedule_filename)
        self._settings = settings
        if self.link.backend is None:
            self.link.backend = backend_from_settings(settings, instance=self.instance_id)
        self._jobs = build_jobs(self.schedule, settings, app_zone(self.app))
        for job in self._jobs.values():
            check_backend_supports(self.link.backend, settings, job)
        seen: dict[tuple[object, ...], object] = {}
        for name, job in self._jobs.items():
            problem = args_problem(self.app, name, job.entry, seen)
            if problem is not None:  # its own slots fail; the other jobs run
                logger.error("anarchon: %s", problem)
        self._warn_if_local_only(settings)
        self.metrics = metrics_from_app(self.app)
        registry_ttl(self.app.conf)  # a bad anarchon_registry_ttl fails here, at start-up
        self._wire(settings)
        self.link.connect(strict=True)
        self.stored.load()
        self.stored.check_limits()
        self.agenda.plan_first_slots()
        self.releaser = start_releaser(self.app, settings, self.instance_id, self.metrics)
        self._setup_done = True

    def _wire(self, settings: Settings) -> None:
        """Build the components over the jobs, settings and metrics."""
        link, clock, metrics = self.link, self._clock, self.metrics
        self.journal = Journal(link, settings, metrics, clock)
        self.agenda = Agenda(self._jobs, link, self.journal.record_absent, metrics, clock)
        self.registry = Registry(
            self.instance_id,
            self._jobs,
            link,
            self.app.conf,
            clock,
            self._random,
            started_ms=self._now_ms(),
            on_peer_left=lambda: self.take_over.check_now(),
            stored=lambda: (self.stored.state.version, self.stored.state.committed_ms),
        )
        self.claimer = Claimer(link, self.agenda, settings, metrics, clock)
        self.publisher = Publisher(
            self.app,
            self.instance_id,
            link,
            self.claimer,
            self.journal,
            self.agenda,
            metrics,
            clock,
            producer=lambda: self.producer,
            drop_producer=self._drop_producer,
            connection=lambda: self.connection,
        )
        self.take_over = TakeOver(
            link,
            self.agenda,
            self.registry,
            self.journal,
            self.publisher,
            settings,
            metrics,
            clock,
            self._random,
        )
        self.overlap = Overlap(link, self.journal, settings, metrics, clock)
        self.stored = StoredJobs(
            self.app,
            settings,
            app_zone(self.app),
            self._jobs,
            link,
            self.agenda,
            self.journal,
            metrics,
            clock,
        )
        self.agenda.on_end = self.stored.ended
        self._wired = True

    def _warn_if_local_only(self, settings: Settings) -> None:
        if scheme_of(settings.backend or "x://") == "sqlite":
            logger.warning(
                "anarchon: claims are kept in a local SQLite file (%s): instances "
                "on this host never send a slot twice, but instances on other hosts "
                "do not see these claims. To run beat on several hosts, set "
                "anarchon_backend to a shared Redis, PostgreSQL, MySQL or RabbitMQ URL.",
                settings.backend,
            )

    # -- the tick ----------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: act on every due slot, then say how long to sleep.

        Returns:
            seconds until the next slot's claim falls due, at most
            ``max_interval`` and at most the registry heartbeat period.
        Raises:
            SystemExit: the scheduler was closed (beat is shutting down).
        """
        if self._close_requested and not self._closed:
            self.close()  # asked for in the middle of the last tick
        if self._closed:
            # Beat closes the scheduler from its SIGTERM handler, then raises
            # SystemExit wherever the main thread is; a library reading a
            # socket that close() shut can turn it into another error that
            # a tick survives. A closed scheduler never ticks on (it would
            # reconnect and send after handing its claims over): exit again.
            raise SystemExit()
        self._ticking = True
        try:
            return self._tick()
        finally:
            self._ticking = False

    def _tick(self) -> float:
        if self._settings is None:  # constructed lazily, then ticked
            self.setup_schedule()
        link = self.link
        now = self._clock()
        if not link.ready and now >= link.retry_at:
            link.connect(strict=False)
        self.stored.refresh()  # before the gaps: a paused slot was never due
        if link.ready and self.agenda.unsettled:
            self.agenda.settle_gaps()  # the backend was away at start-up
        if link.ready and now >= self.registry.next_heartbeat:
            next_due = self.agenda.next_due_ms()
            busy = next_due is not None and next_due < (now + HOUSEKEEPING_BUDGET) * 1000
            self.registry.heartbeat(now, housekeep=not busy)
        if link.ready and self.journal.unrecorded:
            self.journal.record_after_outage()
        if self.journal.unmarked:
            self.journal.flush_marks()  # sent slots a backend blip left unrecorded
        # A job has one slot in the heap at a time, so after a stall or at
        # start-up its next slots can be due at once: keep taking rounds,
        # each one batch, for at most TICK_BUDGET seconds, then yield to beat.
        deadline = time.monotonic() + TICK_BUDGET
        while time.monotonic() < deadline:
            self.stored.refresh_if_stale()  # a busy tick still reads changes in time
            due = self.agenda.pop_due(self._now_ms(), most=ROUND_EVENTS)
            if not due:
                break
            self._process(due)
        return self._sleep_seconds()

    def _sleep_seconds(self) -> float:
        wait = float(self.max_interval)
        heartbeat_in = max(self.registry.next_heartbeat - self._clock(), 0.0)
        wait = min(wait, heartbeat_in or HEARTBEAT_INTERVAL)
        next_due = self.agenda.next_due_ms()
        if next_due is not None:
            wait = min(wait, max((next_due - self._now_ms()) / 1000.0, 0.0))
        if self.journal.unmarked:  # retry recording them when the backend is retried
            wait = min(wait, max(self.link.retry_at - self._clock(), MARK_DELAY))
        if self.stored.enabled:  # read the stored jobs' version at least this often
            wait = min(wait, POLL_INTERVAL)
        return wait

    def _process(self, due: Sequence[Slot]) -> None:
        """Act on one round of due events: record misses, take over expired
        leases (one batch), claim the rest (one batch, at most
        :meth:`Claimer.limit` of them; the others wait in the agenda), send
        what was won, and record it ``sent`` in chunks.

        A job's next slot is planned as soon as its current slot is due
        (``DUE``), whatever this instance's claim delay for the current one,
        so a job more frequent than the jitter never falls behind.
        """
        now_ms = self._now_ms()
        candidates: list[Slot] = []
        take_overs: list[Slot] = []
        misses: list[tuple[Job, list[int], int]] = []  # recorded in one batch
        stored = self.stored
        for slot in due:
            job, kind = slot.job, slot.kind
            held = job.pause is not None or job.retired_ms is not None
            if held and kind in HELD_KINDS and stored.held_back(slot):
                continue
            late = now_ms > job.deadline_ms(slot.slot_ms)
            if kind == TAKE_OVER:
                take_overs.append(slot)
            elif kind == SEND_FAILED:
                self.publisher.close_failed_send(slot)
            elif kind == CATCH_UP:
                candidates.append(slot)
            elif kind == DUE and late:
                misses.append(self.agenda.skip_missed(job, slot.slot_ms, now_ms))
            elif kind == CLAIM and late:
                misses.append((job, [slot.slot_ms], 1))
            else:
                if kind == DUE:
                    self.agenda.advance(job, slot.slot_ms)
                    claim_at = slot.slot_ms + self.registry.claim_delay_ms(job, slot.slot_ms)
                    if claim_at > now_ms:
                        self.agenda.again(claim_at, slot)
                        continue
                candidates.append(slot)
        if misses:
            self.journal.record_misses(misses)
        if take_overs:
            self.take_over.check(take_overs, now_ms)
        if candidates:
            # The claim cap first, then the overlap checks (one history read
            # each): a slot deferred to a later round is checked once, then.
            limit = self.claimer.limit(candidates)
            for slot in candidates[limit:]:
                self.agenda.again(slot.slot_ms, slot)
            claiming: dict[str, int] = {}  # overlap='skip' jobs with a slot in this batch
            batch = [
                slot
                for slot in candidates[:limit]
                if not self.overlap.skip(slot.job, slot.slot_ms, claiming)
            ]
            if batch:
                self._claim_and_send(batch, now_ms)
        self.journal.flush_marks()

    def _claim_and_send(self, batch: Sequence[Slot], now_ms: int) -> None:
        """Claim ``batch`` (at most :meth:`Claimer.limit` slots) in one
        backend call, watch the slots lost to a live owner, send what was
        won, and fold the batch's costs into the next batch's size."""
        started = time.monotonic()
        claims = self.claimer.claim(batch)
        claimed_at, sending = self._clock(), time.monotonic()
        won: list[Slot] = []
        for slot, claim in zip(batch, claims, strict=True):
            if claim.won:
                won.append(slot)
                continue
            self.metrics.lost(slot.job.name)
            logger.debug(
                "anarchon: lost %s @ %s (%s)", slot.job.name, _iso(claim.slot_ms), claim.reason
            )
            if claim.reason == "taken":
                self.take_over.watch(slot.job, claim.slot_ms, now_ms)
            elif claim.reason == "finished":
                self.stored.limit_reached(slot.job, claim.slot_ms)
        sent = self.publisher.send_all(won, claimed_at)
        self.journal.flush_marks()
        if self.link.ready:
            self.claimer.measure(len(batch), sending - started, sent, time.monotonic() - sending)

    # -- beat's broker connection (Celery's, made bounded) -------------------

    def _drop_producer(self) -> None:
        """Forget beat's cached producer and broker connection (Celery's
        ``producer`` and ``connection``), so the next publish makes both
        afresh."""
        self.__dict__.pop("producer", None)
        connection = self.__dict__.pop("connection", None)
        if connection is not None:
            try:
                connection.release()
            except Exception as exc:  # a connection that broke may not close cleanly
                logger.debug("anarchon: releasing a broken broker connection: %r", exc)

    @cached_property
    def connection(self) -> Any:
        """Beat's broker connection for publishing (Celery's, cached the same
        way and released by :meth:`close`), bounded in time
        (:func:`~celery_anarchon.message.bounded_connection`)."""
        return bounded_connection(self.app)

    def _ensure_connected(self) -> Any:
        """Connect beat's broker connection for :attr:`producer`: one
        attempt, bounded by the connection's timeout. (Celery's own retries
        ``broker_connection_max_retries`` times, 100 by default, with
        growing pauses: a tick blocked for many minutes by a broker outage.)

        Raises:
            kombu.exceptions.OperationalError: the broker did not answer.
        """
        return self.connection.ensure_connection(max_retries=0)

    # -- Celery hooks and lifecycle ------------------------------------------

    def apply_entry(self, entry: beat.ScheduleEntry, producer: Any = None) -> None:
        """Not used: slots are sent by :meth:`tick` after a won claim."""
        logger.debug("anarchon: apply_entry(%s) ignored; slots are claimed first", entry.name)

    def sync(self) -> None:
        """Nothing to persist locally: the backend holds all state."""

    def close(self) -> None:
        """Record the queued ``sent`` marks, hand unsent claims over, leave
        the registry and close the backend. Safe to call twice.

        When something is still to record or hand over while the backend is
        in its reconnect backoff (a blip just before shutdown), one
        reconnect is tried at once regardless of the backoff: otherwise
        published slots stay ``claimed`` and a backup publishes them again
        when their leases end."""
        if self._ticking and not self._closed:
            # Called from beat's SIGTERM handler while the main thread is in
            # a tick: it may hold a lock of a client library (redis-py's
            # connection pool lock is not reentrant), and recording or
            # handing over here could wait on it for ever. Beat raises
            # SystemExit right after this call and calls close() again once
            # the tick has unwound; the next tick closes should it not.
            self._close_requested = True
            return
        if not self._closed:
            self._closed = True
            link = self.link
            backend = link.backend
            pending = self._wired and bool(
                self.journal.unmarked or self.claimer.held or self.publisher.failed
            )
            if backend is not None and not link.ready and pending:
                try:
                    link.connect(strict=not self._setup_done)
                except Exception as exc:  # a ConfigurationError before start-up ended
                    logger.warning("anarchon: could not reconnect on shutdown: %r", exc)
            if backend is not None and link.ready:
                if self._wired:
                    self.journal.flush_marks()
                    self._hand_over(backend)
                try:
                    backend.unregister(self.instance_id)
                except Exception as exc:
                    logger.debug("anarchon: could not leave the registry: %r", exc)
            if backend is not None:
                try:
                    backend.close()
                except Exception:
                    logger.exception("anarchon: closing the backend failed")
            link.ready = False
            releaser, self.releaser = self.releaser, None
            if releaser is not None:
                releaser.stop()
            self.metrics.close()
        super().close()

    def _hand_over(self, backend: Backend) -> None:
        """On graceful shutdown, give up the claims this instance won and
        has not sent, each either to another instance or to the record.

        Held claims are released or recorded ``lost``
        (:meth:`Claimer.hand_over`); failed sends stay with their lease
        while a backup can still take them over, else are recorded ``lost``
        (:meth:`Publisher.hand_over`). Records are fenced by token: a slot
        taken over meanwhile keeps the new owner's record."""
        now_ms = self._now_ms()
        release, lost = self.claimer.hand_over(now_ms)
        lost += self.publisher.hand_over(now_ms)
        if release:
            try:
                if isinstance(backend, LeaseBackend):  # claim-only: nothing to give back
                    backend.release(release)
                logger.info("anarchon: handed %d unsent slot(s) over on shutdown", len(release))
            except Exception as exc:
                logger.warning("anarchon: could not hand %d slot(s) over: %r", len(release), exc)
        for claim, error in lost:
            try:
                if backend.mark(claim, State.LOST, error=error):
                    logger.warning(
                        "anarchon: %s @ %s not sent: %s; recorded lost",
                        claim.job,
                        _iso(claim.slot_ms),
                        error,
                    )
            except Exception as exc:
                logger.warning("anarchon: could not record %s lost: %r", claim.job, exc)

    @property
    def info(self) -> str:
        """The line beat's start-up banner shows (no connection is made)."""
        try:
            settings = self._settings or Settings.from_app(
                self.app, schedule_filename=self.schedule_filename
            )
            backend = self.link.backend or backend_from_settings(
                settings, instance=self.instance_id
            )
            where = backend.describe()
        except ConfigurationError as exc:
            where = f"misconfigured ({str(exc).rstrip('.')})"
        jobs = len(self._jobs) or len(self.app.conf.beat_schedule or {})
        return f"    . anarchon -> {where}, {jobs} job(s)"

    # -- what others read ------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The jobs this scheduler runs, by name."""
        return self._jobs

    @property
    def backend(self) -> Backend | None:
        """The claim backend (None before set-up)."""
        return self.link.backend

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (a closed scheduler never ticks on)."""
        return self._closed

    def instance_info(self) -> InstanceInfo:
        """This instance as the registry keeps it (:meth:`Registry.instance_info`)."""
        return self.registry.instance_info()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)
