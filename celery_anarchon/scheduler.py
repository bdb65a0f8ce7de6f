"""The Celery side: a beat ``Scheduler`` that claims every slot before sending.

Start it on every host::

    celery -A proj beat -S celery_anarchon.Scheduler

Each tick pops the due slots from a heap (cost per due slot, not per job),
records the ones later than ``max_late`` as missed, claims the rest in one
batch on the shared backend, and sends only what this instance won, through
Celery's own ``apply_async`` path. Any doubt counts as lost: an unclaimed slot
is never sent (DESIGN section 3).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import hashlib
import heapq
import logging
import os
import random
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import cached_property
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from . import __version__
from .backends import backend_from_url, scheme_of
from .backends.base import (
    AbsentRecord,
    Backend,
    Claim,
    ClaimRequest,
    InstanceInfo,
    LeaseBackend,
    RunRecord,
    State,
)
from .exceptions import BackendUnavailable, ConfigurationError
from .metrics import Metrics, metrics_from_app
from .settings import JobOptions, Settings, seconds, started_by_beat
from .slots import Slots, cron, first_slot, oneoff, slots_for
from .worker import expires_for, message_expiry_ms

__all__ = [
    "Entry",
    "Job",
    "Scheduler",
    "build_jobs",
    "check_backend_supports",
    "send_slot",
    "task_id_for",
]

logger = logging.getLogger(__name__)

#: Namespace of the task ids derived from ``(job, slot)``.
TASK_ID_NAMESPACE = uuid.UUID("6b3f4a52-2d0e-4c1e-9a55-0d1f3c7e8a90")

#: Extra time a claim record is kept after the last instant a late instance
#: could still try it, milliseconds.
KEEP_MARGIN_MS = 60_000

#: Registry heartbeat period and default time-to-live, seconds (the TTL is
#: the ``anarchon_registry_ttl`` setting, see :func:`registry_ttl`).
HEARTBEAT_INTERVAL = 5.0
REGISTRY_TTL = 30.0

#: Most time a heartbeat gives the backend's deferred upkeep, seconds.
HOUSEKEEPING_BUDGET = 0.5

#: Reconnect backoff bounds while the backend is away, seconds.
BACKOFF_MIN = 1.0
BACKOFF_MAX = 30.0

#: Publishing to Celery's broker: attempts of one publish, each on a broker
#: connection made afresh after a failure with one connect attempt (bounded
#: by ``broker_connection_timeout``); after a publish failed, further sends
#: fail at once for PUBLISH_PAUSE seconds, so a tick with many won slots and
#: an unreachable broker is not blocked once per slot.
PUBLISH_ATTEMPTS = 2
PUBLISH_PAUSE = 1.0

#: Least time left before ``max_late`` for a claim released on shutdown,
#: seconds: the other instances see this one leave the registry at their
#: next heartbeat (one period), then take the slot in a tick (another
#: period's margin for a loaded machine).
HAND_OVER_MARGIN = 2 * HEARTBEAT_INTERVAL

#: Share of its lease a claim may have been held when its publish starts;
#: later, a backup runner may be taking the slot over (a second publish).
PUBLISH_BY = 0.8

#: kombu transports that ignore ``connect_timeout`` (their own socket
#: timeouts are set instead, see :attr:`Scheduler.connection`).
REDIS_TRANSPORTS = frozenset({"redis", "rediss", "sentinel"})

#: Kinds of heap events: a job's next slot is due; claim a slot after this
#: instance's claim delay; check whether a lost slot's owner died (backup
#: runner); claim a slot missed while every instance was down (catch-up);
#: record lost a claim whose send failed and that no backup took over.
DUE, CLAIM, TAKE_OVER, CATCH_UP, SEND_FAILED = 0, 1, 2, 3, 4

#: How long a run that was sent but never started counts as in flight for
#: ``overlap='skip'``, seconds (a worker backlog of up to an hour).
SENT_IN_FLIGHT = 3600.0

#: Records of slots that were never run (skipped by policy or missed).
NOT_RUN = frozenset({State.MISSED, State.SKIPPED})

#: Longest a tick keeps taking rounds of due slots before returning, seconds.
TICK_BUDGET = 1.0

#: Most missed slots of one job recorded one by one after a long stall; the
#: rest are counted in the log line, up to MAX_MISSES_COUNTED, past which the
#: job skips ahead without counting (a stall of days for a 1 ms interval).
MAX_MISSES_RECORDED = 100
MAX_MISSES_COUNTED = 1_000_000

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

#: A peer whose last heartbeat is this much older than the newest one in the
#: registry counts as dead (for rendezvous ranks and take-over checks) before
#: the registry drops it, seconds.
PEER_STALE = 2 * HEARTBEAT_INTERVAL

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

#: A batch still sending ``lease_ttl / RELEASE_SHARE`` after its claim (the
#: estimate was wrong) gives the rest back to be claimed afresh.
RELEASE_SHARE = 3


class _StaleClaim(Exception):
    """A won claim was held too long to publish (its lease nearly ended)."""

    def __init__(self, held_s: float) -> None:
        super().__init__(f"claim held {held_s:.1f}s")
        self.held_s = held_s


class _PublishInDoubt(Exception):
    """A publish failed after it may have reached Celery's broker (the
    connection broke or timed out during or after the write): sending it
    again, here or by a backup, could publish the slot twice."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.cause = cause


def _refused(exc: BaseException) -> bool:
    """True when ``exc`` says the broker connection could not be made at
    all (refused, or the host name did not resolve), so nothing was
    written: the exception itself or what it wraps (``__cause__``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (ConnectionRefusedError, socket.gaierror)):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def task_id_for(job: str, slot_ms: int) -> str:
    """The Celery task id of ``job``'s run at ``slot_ms``: the same on every
    host, so a second publish of one slot carries the same id."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{job}\x00{slot_ms}"))


def manual_task_id(job: str, key: str) -> str:
    """The task id of a ``run_now`` of ``job`` under ``key``."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{job}\x00manual\x00{key}"))


def _weight(instance: str, key: bytes) -> int:
    """Rendezvous weight of ``instance`` for a slot ``key``."""
    digest = hashlib.blake2b(instance.encode() + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def new_instance_id() -> str:
    """``host:pid:random``, unique per scheduler process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def registry_ttl(conf: Any) -> float:
    """``anarchon_registry_ttl``, seconds (default :data:`REGISTRY_TTL`): an
    instance killed without a graceful shutdown drops out of the registry
    this long after its last heartbeat.

    Raises:
        ConfigurationError: not a duration, or below two heartbeat periods
            (a live instance would blink out between heartbeats).
    """
    value = conf.get("anarchon_registry_ttl")
    ttl = REGISTRY_TTL if value is None else seconds(value, setting="anarchon_registry_ttl")
    if ttl < 2 * HEARTBEAT_INTERVAL:
        raise ConfigurationError(
            f"anarchon_registry_ttl ({ttl:g}s) must be at least {2 * HEARTBEAT_INTERVAL:g}s, "
            f"two heartbeat periods of {HEARTBEAT_INTERVAL:g}s; raise it."
        )
    return ttl


class Entry(beat.ScheduleEntry):
    """A ``beat_schedule`` entry that also takes an ``'anarchon'`` key (per-job
    options) and schedules Celery itself does not: cron strings and one-off
    datetimes.

    Celery's own scheduler rejects the ``'anarchon'`` key: remove it when
    switching back.
    """

    def __init__(
        self,
        name: str | None = None,
        task: str | None = None,
        last_run_at: datetime | None = None,
        total_run_count: int | None = None,
        schedule: Any = None,
        args: Any = (),
        kwargs: Any = None,
        options: Any = None,
        relative: bool = False,
        app: Any = None,
        anarchon: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(schedule, str):
            schedule = cron(schedule)
        elif isinstance(schedule, datetime):
            schedule = oneoff(schedule)
        elif not isinstance(schedule, (int, float, timedelta)) and not hasattr(schedule, "is_due"):
            raise ConfigurationError(
                f"beat_schedule[{name!r}]['schedule']: {schedule!r} is not a schedule. Fix: "
                "give seconds, a timedelta, a crontab/solar/cron object, a cron string "
                "or an aware datetime."
            )
        self.anarchon = dict(anarchon or {})
        super().__init__(
            name=name,
            task=task,
            last_run_at=last_run_at,
            total_run_count=total_run_count,
            schedule=schedule,
            args=args,
            kwargs=kwargs,
            options=options,
            relative=relative,
            app=app,
        )

    def update(self, other: beat.ScheduleEntry) -> None:
        super().update(other)
        self.anarchon = dict(getattr(other, "anarchon", {}))

    def editable_fields_equal(self, other: beat.ScheduleEntry) -> bool:
        return super().editable_fields_equal(other) and self.anarchon == getattr(
            other, "anarchon", {}
        )

    def __reduce__(self) -> Any:
        cls, args = super().__reduce__()
        return _rebuild_entry, (cls, args, self.anarchon)


def _rebuild_entry(cls: type[Entry], args: tuple[Any, ...], anarchon: dict[str, Any]) -> Entry:
    entry = cls(*args)
    entry.anarchon = anarchon
    return entry


@dataclass
class Job:
    """One scheduled job as the scheduler runs it.

    Attributes:
        name: the ``beat_schedule`` key.
        entry: the Celery entry (task, args, options).
        slots: the job's slot arithmetic.
        options: its effective options.
        definition: a stable text of its definition (same on every host that
            runs the same schedule), for drift detection.
        next_slot_ms: the next slot to act on, epoch ms, or None when done.
    """

    name: str
    entry: Entry
    slots: Slots
    options: JobOptions
    definition: str
    next_slot_ms: int | None = None

    def claim_request(self, slot_ms: int, max_skew: float) -> ClaimRequest:
        """The claim request for ``slot_ms`` with this job's windows."""
        o = self.options
        jitter_ms, late_ms, skew_ms = _ms(o.jitter), _ms(o.max_late), _ms(max_skew)
        return ClaimRequest(
            job=self.name,
            slot_ms=slot_ms,
            window_before_ms=late_ms + jitter_ms,
            window_after_ms=skew_ms,
            keep_until_ms=slot_ms + jitter_ms + late_ms + skew_ms + KEEP_MARGIN_MS,
            lease_ms=_ms(o.lease_ttl),
            history_size=o.history_size,
            history_ttl_ms=_ms(o.history_ttl),
        )

    def keep_until_ms(self, slot_ms: int, max_skew: float) -> int:
        """Until when a record of ``slot_ms`` must be kept, epoch ms."""
        return self.claim_request(slot_ms, max_skew).keep_until_ms


def _ms(value_s: float) -> int:
    return int(round(value_s * 1000))


def app_zone(app: Any) -> ZoneInfo:
    """The app's ``timezone`` as a ZoneInfo (UTC when unset)."""
    name = app.conf.timezone or "UTC"
    try:
        return ZoneInfo(str(name))
    except Exception as exc:
        raise ConfigurationError(
            f"timezone: unknown time zone {name!r}; use an IANA name such as 'Europe/Berlin'."
        ) from exc


def build_jobs(
    entries: Mapping[str, beat.ScheduleEntry], settings: Settings, zone: ZoneInfo
) -> dict[str, Job]:
    """Validate every entry and build its :class:`Job`.

    Raises:
        ConfigurationError: a bad schedule or per-job option, naming the job.
    """
    jobs = {}
    shared: dict[Any, Slots] = {}  # one Slots per distinct definition
    for name, entry in entries.items():
        overrides = getattr(entry, "anarchon", None)
        options = settings.job_options(name, overrides)
        slots = slots_for(
            entry.schedule, job=name, tz=zone, anchor_ms=options.anchor_ms, shared=shared
        )
        text = "\x00".join(
            [
                slots.describe(),  # what definition() gives, without building again
                str(entry.task),
                repr(entry.args),
                repr(sorted((entry.kwargs or {}).items())),
            ]
        )
        jobs[name] = Job(name, entry, slots, options, hashlib.sha1(text.encode()).hexdigest()[:12])
    return jobs


def check_backend_supports(backend: Backend, settings: Settings, job: Job) -> None:
    """Refuse a job whose options need what ``backend`` cannot give.

    Raises:
        ConfigurationError: on a claim-only backend (RabbitMQ), a job asking
            for ``lease_ttl``, ``overlap='skip'``, a catch-up policy or an
            explicit ``history_ttl``; or the backend's own check of the job
            (RabbitMQ: ``jitter + max_late + max_skew`` against ``slot_ttl``).
    """
    if backend.supports_leases:
        return
    o = job.options
    asked = []
    if "lease_ttl" in settings.explicit or "lease_ttl" in job.entry.anarchon:
        asked.append("lease_ttl (backup runners)")
    if o.overlap == "skip":
        asked.append("overlap='skip'")
    if o.catch_up != "none":
        asked.append(f"catch_up={o.catch_up!r}")
    if "history_ttl" in settings.explicit or "history_ttl" in job.entry.anarchon:
        asked.append("history_ttl (RabbitMQ history is trimmed by size only)")
    if asked:
        raise ConfigurationError(
            f"job {job.name!r}: {', '.join(asked)} need a lease backend; "
            f"{backend.describe()} is claim-only. Remove the setting, or set "
            "anarchon_backend to Redis, PostgreSQL or SQLite."
        )
    backend.check_job(
        job.name, jitter_s=o.jitter, max_late_s=o.max_late, max_skew_s=settings.max_skew
    )


def send_slot(
    app: Any,
    entry: beat.ScheduleEntry,
    *,
    job: str,
    slot_ms: int,
    token: int | str | None,
    task_id: str,
    producer: Any = None,
    expires: datetime | None = None,
    retry: bool | None = None,
) -> Any:
    """Send ``entry``'s task for one slot through Celery's own path.

    ``apply_async`` with the entry's args, kwargs and options (routing,
    queue, expires, ...) untouched, plus the task id and the headers
    ``anarchon_job``, ``anarchon_slot`` (epoch ms), ``anarchon_token`` and
    Celery beat's own ``celery_beat_task``. ``retry`` (when not None)
    replaces the entry's and ``task_publish_retry``: the scheduler passes
    False and retries itself, bounded (:meth:`Scheduler._publish`).

    Returns:
        the ``AsyncResult``.
    Raises:
        Exception: whatever ``apply_async`` raises (broker errors).
    """
    options = dict(entry.options or {})
    headers = dict(options.pop("headers", None) or {})
    headers.update(
        celery_beat_task=True,
        anarchon_job=job,
        anarchon_slot=slot_ms,
        anarchon_token=token,
    )
    options.pop("task_id", None)
    if expires is not None:  # anarchon_expires; the entry's own option wins
        options.setdefault("expires", expires)
    if retry is not None:
        options["retry"] = retry
    args = beat._evaluate_entry_args(entry.args)
    kwargs = beat._evaluate_entry_kwargs(entry.kwargs)
    task = app.tasks.get(entry.task)
    if task is not None:
        return task.apply_async(
            args, kwargs, producer=producer, task_id=task_id, headers=headers, **options
        )
    return app.send_task(
        entry.task, args, kwargs, producer=producer, task_id=task_id, headers=headers, **options
    )


class Scheduler(beat.Scheduler):
    """Celery beat scheduler that claims each slot once across instances.

    Honours Celery's scheduler contract: constructing with ``lazy=True``
    connects nothing; :meth:`close` may run twice (beat calls it twice on
    SIGTERM); :meth:`tick` never raises into beat's loop because of a backend
    or broker error.

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
        self._backend: Backend | None = backend
        self._backend_ready = False
        self._settings: Settings | None = None
        self._jobs: dict[str, Job] = {}
        #: heap of (due ms, sequence, kind, job name, slot ms)
        self._events: list[tuple[int, int, int, str, int]] = []
        #: live instance ids (this one included) from the registry
        self._peers: list[str] = []
        #: won claims not yet sent, released on shutdown (hand-over)
        self._held: dict[tuple[str, int], Claim] = {}
        #: records (job, slot, state, error) to write once the backend answers
        self._unrecorded: collections.deque[tuple[str, int, State, str]] = collections.deque(
            maxlen=MAX_UNRECORDED
        )
        #: slots lost to another owner and due a take-over check: (job, slot)
        self._take_over_due: set[tuple[str, int]] = set()
        #: of those, the ones this instance checks only if a peer died (its
        #: rank is TAKE_OVER_RANKS or later): the peers it saw live when it lost
        self._take_over_gated: dict[tuple[str, int], list[str]] = {}
        #: sent slots not yet recorded ``sent``: (job, claim, task id, retry
        #: until ms), and when the oldest was queued (time.monotonic())
        self._unmarked: list[tuple[Job, Claim, str, int]] = []
        self._unmarked_since = 0.0
        #: measured seconds per claimed slot and per sent slot, or None
        self._claim_cost: float | None = None
        self._send_cost: float | None = None
        #: claims whose send failed, left to a backup:
        #: (job, slot) -> (claim, error, latest end of its lease in epoch ms)
        self._failed_sends: dict[tuple[str, int], tuple[Claim, str, int]] = {}
        #: job -> first slot planned at start-up, while its gap is not settled
        self._unsettled: dict[str, int] = {}
        #: no publish is tried before this time.monotonic() (broker away), and why
        self._publish_paused_until = 0.0
        self._publish_error = ""
        #: (job, instance, definition) drift already warned about
        self._drift_seen: set[tuple[str, str, str]] = set()
        #: (instance, fingerprint) of peers whose definitions were compared
        self._drift_read: set[tuple[str, str]] = set()
        #: (jobs mapping, {job: definition}, fingerprint), see _schedule_definitions
        self._definitions_cache: tuple[Mapping[str, Job], dict[str, str], str] | None = None
        #: the fingerprint whose definitions the registry holds for us, if known
        self._definitions_stored: str | None = None
        self._seq = 0
        self._started_ms = 0
        #: True once setup_schedule finished (start-up errors stop beat only before)
        self._setup_done = False
        self._next_heartbeat = 0.0
        self._outage_since: float | None = None
        self._outage_lost = 0
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN
        self._closed = False
        self._ticking = False  # inside tick() (close() from a signal handler waits)
        self._close_requested = False
        self._random = random.Random()
        self.metrics: Metrics = Metrics()
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
        from .cli import _run_check  # the check command's own collector

        try:
            problems = [
                p["message"] for p in _run_check(self.app, self.schedule_filename, False).problems
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

    def _set_up(self) -> None:
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        self._settings = Settings.from_app(self.app, schedule_filename=self.schedule_filename)
        if self._backend is None:
            self._backend = backend_from_url(
                self._settings.backend,
                instance=self.instance_id,
                options=self._settings.effective_backend_options(),
                client=self._settings.backend_client,
            )
        self._jobs = build_jobs(self.schedule, self._settings, app_zone(self.app))
        for job in self._jobs.values():
            check_backend_supports(self._backend, self._settings, job)
        self._warn_if_local_only()
        self.metrics = metrics_from_app(self.app)
        registry_ttl(self.app.conf)  # a bad anarchon_registry_ttl fails here, at start-up
        self._started_ms = self._now_ms()
        self._connect()
        self._plan_first_slots()
        self._setup_done = True
        # The jobs live as long as the process: keep them out of the cyclic
        # garbage collector, whose full passes over a large schedule pause a
        # tick (about 7 s at 100,000 jobs on the benchmark machine). No
        # collection first: it would cost a full pass at every start-up.
        gc.freeze()

    def _warn_if_local_only(self) -> None:
        assert self._settings is not None
        if scheme_of(self._settings.backend or "x://") == "sqlite":
            logger.warning(
                "anarchon: claims are kept in a local SQLite file (%s): instances "
                "on this host never send a slot twice, but instances on other hosts "
                "do not see these claims. To run beat on several hosts, set "
                "anarchon_backend to a shared Redis, PostgreSQL, MySQL or RabbitMQ URL.",
                self._settings.backend,
            )

    def _plan_first_slots(self) -> None:
        """Plan each job's first slot: the first after ``now - max_late``
        (DESIGN section 2), and settle what happened while no instance ran
        (:meth:`_settle_gaps`): now, or once the backend answers when it is
        away at start-up."""
        now_ms = self._now_ms()
        self._events = []
        for job in self._jobs.values():
            job.next_slot_ms = first_slot(job.slots, now_ms, _ms(job.options.max_late))
            self._push(job)
        self._unsettled = {
            name: job.next_slot_ms
            for name, job in self._jobs.items()
            if job.next_slot_ms is not None
        }
        if self._backend_ready:
            self._settle_gaps()

    def _settle_gaps(self) -> None:
        """Settle each job's gap between the backend's last record of it and
        its first slot planned at start-up (:meth:`_settle_gap`), once.
        Called at start-up and, while that has not happened (the backend was
        away), as soon as the backend answers, before anything this
        instance records itself: the slots of the gap were never acted on
        by anybody and must still be recorded missed or caught up."""
        if not self._unsettled:
            return
        last_slots = self._last_slots()
        if not self._backend_ready:  # the read failed: again at the next answer
            return
        pending, self._unsettled = self._unsettled, {}
        now_ms = self._now_ms()
        for name, first_ms in pending.items():
            job = self._jobs.get(name)
            last = last_slots.get(name)
            if job is not None and last is not None:
                self._settle_gap(job, last, first_ms, now_ms)

    def _last_slots(self) -> dict[str, int]:
        """``job -> newest scheduled slot the backend has a record of``
        (lease backends; claim-only backends keep no such record)."""
        backend = self._backend
        assert backend is not None
        if not backend.supports_leases:
            return {}
        try:
            return backend.last_slots(list(self._jobs))  # batched: one pipeline or query
        except BackendUnavailable as exc:
            self._on_outage(exc)
        return {}

    def _settle_gap(self, job: Job, last_ms: int, first_ms: int, now_ms: int) -> None:
        """Slots after the backend's last record of ``job`` and before its
        first slot now were never acted on: every instance was down. Inside
        ``catch_up_window`` they are sent or recorded ``missed`` by the
        job's catch-up policy (DESIGN section 4, "Catch-up"):

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
        while slot is not None and slot < first_ms:
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
            self.metrics.missed(job.name, recorded)
            logger.warning(
                "anarchon: %d slot(s) of %s passed while no instance ran; recorded "
                "as missed (catch_up=%r)",
                recorded,
                job.name,
                o.catch_up,
            )
        for s in send:
            self._push_event(s, CATCH_UP, job.name, s)  # oldest first, before the rest

    # -- the heap ----------------------------------------------------------

    def _push(self, job: Job) -> None:
        """Plan ``job``'s next slot: a ``DUE`` event at the slot itself. The
        claim then happens at once or after this instance's claim delay
        (:meth:`_claim_delay_ms`), scheduled in the heap, never slept."""
        if job.next_slot_ms is not None:
            self._push_event(job.next_slot_ms, DUE, job.name, job.next_slot_ms)

    def _push_event(self, due_ms: int, kind: int, name: str, slot_ms: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (due_ms, self._seq, kind, name, slot_ms))

    def _claim_delay_ms(self, job: Job, slot_ms: int) -> int:
        """The claim delay of ``slot_ms`` for this instance, milliseconds.

        With a registry of live instances (lease backends), the slot's
        preferred owner by rendezvous hashing claims at once and every other
        instance, a backup, after the full jitter: a burst is spread evenly
        and lateness stays near zero. When the registry shows this instance
        alone, it claims at once (a delay would only make it late). Without
        a registry (claim-only backends, or before the first heartbeat), a
        random delay in ``[0, jitter]`` per instance and slot.
        """
        jitter_ms = _ms(job.options.jitter)
        if self._peers == [self.instance_id]:
            return 0
        if len(self._peers) > 1:
            return 0 if self._rank(job.name, slot_ms) == 0 else jitter_ms
        return self._random.randint(0, jitter_ms) if jitter_ms else 0

    def _rank(self, job: str, slot_ms: int) -> int:
        """This instance's place in the slot's rendezvous order (0 = preferred)."""
        key = f"\x00{job}\x00{slot_ms}".encode()
        mine = _weight(self.instance_id, key)
        return sum(1 for peer in self._peers if _weight(peer, key) > mine)

    def _pop_due(self, now_ms: int) -> list[tuple[int, Job, int]]:
        due = []
        while self._events and self._events[0][0] <= now_ms:
            _, _, kind, name, slot_ms = heapq.heappop(self._events)
            job = self._jobs.get(name)
            if job is None:
                continue
            if kind == DUE and job.next_slot_ms != slot_ms:
                continue  # stale: the job moved on
            due.append((kind, job, slot_ms))
        return due

    def _advance(self, job: Job, slot_ms: int) -> None:
        job.next_slot_ms = job.slots.next_after(slot_ms)
        self._push(job)

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
        now = self._clock()
        if not self._backend_ready and now >= self._retry_at:
            self._connect()
        if self._backend_ready and self._unsettled:
            self._settle_gaps()  # the backend was away at start-up
        if self._backend_ready and now >= self._next_heartbeat:
            self._heartbeat(now)
        if self._backend_ready and self._unrecorded:
            self._record_after_outage()
        if self._unmarked:
            self._flush_marks()  # sent slots a backend blip left unrecorded
        # A job has one slot in the heap at a time, so after a stall or at
        # start-up its next slots can be due at once: keep taking rounds,
        # each one batch, for at most TICK_BUDGET seconds, then yield to beat.
        deadline = time.monotonic() + TICK_BUDGET
        while time.monotonic() < deadline:
            due = self._pop_due(self._now_ms())
            if not due:
                break
            self._process(due)
        return self._sleep_seconds()

    def _sleep_seconds(self) -> float:
        wait = float(self.max_interval)
        wait = min(wait, max(self._next_heartbeat - self._clock(), 0.0) or HEARTBEAT_INTERVAL)
        if self._events:
            wait = min(wait, max((self._events[0][0] - self._now_ms()) / 1000.0, 0.0))
        if self._unmarked:  # retry recording them when the backend is retried
            wait = min(wait, max(self._retry_at - self._clock(), MARK_DELAY))
        return wait

    def _process(self, due: Sequence[tuple[int, Job, int]]) -> None:
        """Act on one round of due events: record misses, take over expired
        leases (one batch), claim the rest (one batch, at most
        :meth:`_claim_limit` of them; the others wait in the heap), send
        what was won, and record it ``sent`` in chunks.

        A job's next slot is planned as soon as its current slot is due
        (``DUE``), whatever this instance's claim delay for the current one,
        so a job more frequent than the jitter never falls behind.
        """
        assert self._settings is not None
        now_ms = self._now_ms()
        candidates: list[tuple[Job, int, bool]] = []
        take_overs: list[tuple[Job, int]] = []
        misses: list[tuple[Job, list[int], int]] = []  # recorded in one batch
        for kind, job, slot_ms in due:
            late = now_ms > slot_ms + _ms(job.options.max_late)
            if kind == TAKE_OVER:
                take_overs.append((job, slot_ms))
            elif kind == SEND_FAILED:
                self._close_failed_send(job, slot_ms)
            elif kind == CATCH_UP:
                candidates.append((job, slot_ms, True))
            elif kind == DUE and late:
                misses.append(self._skip_missed(job, slot_ms, now_ms))
            elif kind == CLAIM and late:
                misses.append((job, [slot_ms], 1))
            else:
                if kind == DUE:
                    self._advance(job, slot_ms)
                    claim_at = slot_ms + self._claim_delay_ms(job, slot_ms)
                    if claim_at > now_ms:
                        self._push_event(claim_at, CLAIM, job.name, slot_ms)
                        continue
                candidates.append((job, slot_ms, False))
        if misses:
            self._record_misses(misses)
        if take_overs:
            self._take_over(take_overs, now_ms)
        if candidates:
            # The claim cap first, then the overlap checks (one history read
            # each): a slot deferred to a later round is checked once, then.
            limit = self._claim_limit(candidates)
            for job, slot_ms, catch_up in candidates[limit:]:
                self._push_event(slot_ms, CATCH_UP if catch_up else CLAIM, job.name, slot_ms)
            claiming: dict[str, int] = {}  # overlap='skip' jobs with a slot in this batch
            to_claim = [
                (job, slot_ms, catch_up)
                for job, slot_ms, catch_up in candidates[:limit]
                if not self._skip_for_overlap(job, slot_ms, claiming)
            ]
            if to_claim:
                self._claim_and_send(to_claim, now_ms)
        self._flush_marks()

    def _claim_and_send(self, to_claim: Sequence[tuple[Job, int, bool]], now_ms: int) -> None:
        """Claim ``(job, slot, catch_up)`` slots in one batch of at most
        :meth:`_claim_limit`, planning the rest as claims due now (the next
        round of this tick, or the next tick); send what was won."""
        limit = self._claim_limit(to_claim)
        for job, slot_ms, catch_up in to_claim[limit:]:
            self._push_event(slot_ms, CATCH_UP if catch_up else CLAIM, job.name, slot_ms)
        batch = to_claim[:limit]
        started = time.monotonic()
        claims = self._claim(batch)
        claimed_at, sending = self._clock(), time.monotonic()
        # Held until sent: a shutdown in the middle of this batch releases
        # the rest (hand-over) instead of leaving them to lease expiry.
        self._held.update({(c.job, c.slot_ms): c for c in claims if c.won})
        won: list[tuple[Job, Claim, bool]] = []
        for (job, _, catch_up), claim in zip(batch, claims, strict=True):
            if claim.won:
                won.append((job, claim, catch_up))
                continue
            self.metrics.lost(job.name)
            logger.debug("anarchon: lost %s @ %s (%s)", job.name, _iso(claim.slot_ms), claim.reason)
            if claim.reason == "taken":
                self._plan_take_over(job, claim.slot_ms, now_ms)
        sent = self._send_all(won, claimed_at)
        self._flush_marks()
        if self._backend_ready:
            self._measure(len(batch), sending - started, sent, time.monotonic() - sending)

    def _send_all(self, won: Sequence[tuple[Job, Claim, bool]], claimed_at: float) -> int:
        """Send won ``(job, claim, catch_up)`` claims in order, recording
        ``sent`` in chunks; how many were sent. Should sending run past
        ``lease_ttl / RELEASE_SHARE`` (the shortest lease of the batch; this
        instance is slower than measured, e.g. a loaded machine), the rest
        is given back (:meth:`_give_back`) instead of being sent on a lease
        running short."""
        budget = min((job.options.lease_ttl for job, _, _ in won), default=0.0) / RELEASE_SHARE
        for index, (job, claim, _) in enumerate(won):
            if self._clock() - claimed_at > budget:
                self._give_back(won[index:])
                return index
            self._send(job, claim, claimed_at)
        return len(won)

    def _give_back(self, rest: Sequence[tuple[Job, Claim, bool]]) -> None:
        """Release claims this batch could not send in time (fenced: see
        :meth:`Backend.release`) and plan them as claims due now, so this
        instance or another claims them afresh, with a full lease. If the
        release fails they stay claimed, and a backup takes them over when
        their lease ends."""
        assert self._backend is not None
        claims = [claim for _, claim, _ in rest]
        for job, claim, _ in rest:
            self._held.pop((job.name, claim.slot_ms), None)
        try:
            if isinstance(self._backend, LeaseBackend):  # claim-only: nothing to give back
                self._backend.release(claims)
        except BackendUnavailable as exc:
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: releasing %d claim(s) failed", len(claims))
        for job, claim, catch_up in rest:
            kind = CATCH_UP if catch_up else CLAIM
            self._push_event(claim.slot_ms, kind, job.name, claim.slot_ms)
        logger.info(
            "anarchon: gave %d claimed slot(s) back to be claimed afresh: this instance sent "
            "slower than measured, and their leases would run short",
            len(claims),
        )

    def _claim_limit(self, to_claim: Sequence[tuple[Job, int, bool]]) -> int:
        """The most slots to claim in one batch: as many as this instance
        claims and sends in ``lease_ttl / LEASE_SHARE`` (the shortest lease
        among the slots) should it win them all, at its measured costs
        (:data:`FIRST_SEND_COST` per send before one is measured), at least
        :data:`MIN_CLAIM_BATCH`. No limit on a claim-only backend (no lease
        for a backup to take over)."""
        backend = self._backend
        if backend is None or not backend.supports_leases:
            return len(to_claim)
        lease_s = min(job.options.lease_ttl for job, _, _ in to_claim)
        per_slot = (self._claim_cost or 0.0) + (self._send_cost or FIRST_SEND_COST)
        return min(MAX_CLAIM_BATCH, max(MIN_CLAIM_BATCH, int(lease_s / LEASE_SHARE / per_slot)))

    def _measure(self, claimed: int, claim_s: float, sent: int, send_s: float) -> None:
        """Fold one batch (``claimed`` slots claimed in ``claim_s`` seconds,
        ``sent`` of them sent and recorded in ``send_s``) into the measured
        costs per slot (small batches are not measured). A cost that rose
        is taken at once, one that fell is averaged in: a slowdown (other
        instances started sending, the machine got busy) shrinks the next
        batch at once."""
        if claimed >= MIN_CLAIM_BATCH:
            self._claim_cost = _average(self._claim_cost, claim_s / claimed)
        if sent >= MIN_SENDS_MEASURED:
            self._send_cost = _average(self._send_cost, send_s / sent)

    def _claim(self, due: Sequence[tuple[Job, int, bool]]) -> list[Claim]:
        """Claim a batch; ``(job, slot, catch_up)`` each. Never raises:
        anything but a clear answer counts as lost."""
        assert self._settings is not None
        lost = [Claim(job.name, slot_ms, won=False, reason="unknown") for job, slot_ms, _ in due]
        if not self._backend_ready or self._backend is None:
            self._retry_later(due)
            return lost
        now_ms = self._now_ms()
        requests = [
            self._catch_up_request(job, slot_ms, now_ms)
            if catch_up
            else job.claim_request(slot_ms, self._settings.max_skew)
            for job, slot_ms, catch_up in due
        ]
        started = time.perf_counter()
        try:
            claims = self._backend.claim(requests)
        except BackendUnavailable as exc:
            self.metrics.backend_error("claim")
            self._on_outage(exc)
            self._retry_later(due)
            return lost
        except Exception:  # never let a backend bug stop beat; never send unclaimed
            logger.exception("anarchon: claim failed; %d slot(s) not sent", len(due))
            return lost
        self.metrics.backend_call("claim", time.perf_counter() - started)
        self._on_success()
        if len(claims) != len(requests):
            logger.error("anarchon: backend answered %d of %d claims", len(claims), len(due))
            return lost
        return claims

    def _retry_later(self, due: Sequence[tuple[Job, int, bool]]) -> None:
        """The backend did not answer: try these claims again when it is
        retried. A slot that is past ``max_late`` by then is recorded
        ``missed`` once the backend answers (never silently dropped)."""
        self._outage_lost += len(due)
        retry_ms = max(int(self._retry_at * 1000), self._now_ms() + 1000)
        for job, slot_ms, catch_up in due:
            self._push_event(retry_ms, CATCH_UP if catch_up else CLAIM, job.name, slot_ms)

    def _catch_up_request(self, job: Job, slot_ms: int, now_ms: int) -> ClaimRequest:
        """A claim request for a catch-up slot: its window reaches back to it."""
        assert self._settings is not None
        request = job.claim_request(slot_ms, self._settings.max_skew)
        back_ms = now_ms - slot_ms + request.window_before_ms
        keep_ms = now_ms + request.keep_until_ms - slot_ms
        return dataclasses.replace(request, window_before_ms=back_ms, keep_until_ms=keep_ms)

    # -- backup runners ----------------------------------------------------

    def _plan_take_over(self, job: Job, slot_ms: int, now_ms: int, *, again: bool = False) -> None:
        """After losing ``slot_ms`` (or, ``again``, after a take-over check
        found another holder's lease still running), plan to check it once
        that lease ends: if its holder died before recording its send, this
        instance takes the slot over. When the lease outlives ``max_late``,
        the check falls just after ``max_late`` and records the slot
        ``lost`` if its lease ended unsent (:meth:`_record_lost_claims`).

        With a registry, the slot's rendezvous order staggers the checks:
        ranks 0 and 1 check at the lease's end (plus a random part of the
        jitter), rank 2 one heartbeat period later, a later rank ``r``
        ``r - 1`` periods later (at the last chance before ``max_late`` at
        the latest) and only if one of the peers it saw live has died by
        then (:data:`TAKE_OVER_RANKS`). A second check (``again``) falls at
        the lease's end whatever the rank."""
        backend = self._backend
        if backend is None or not backend.supports_leases:
            return
        key = (job.name, slot_ms)
        rank = 0 if again or len(self._peers) < 2 else self._rank(job.name, slot_ms)
        lease_ms = _ms(job.options.lease_ttl)
        last_ms = slot_ms + _ms(job.options.max_late)
        # Due a check at once should a peer leave the registry (it hands
        # the slot over on shutdown, or died), until max_late.
        self._take_over_due.add(key)
        if rank >= TAKE_OVER_RANKS:
            self._take_over_gated[key] = self._peers
        else:
            self._take_over_gated.pop(key, None)
        if now_ms + lease_ms > last_ms:
            # The lease outlives max_late: checked just after it (recorded
            # lost if the lease ended unsent), or at once on a hand-over.
            self._push_event(last_ms + 1, TAKE_OVER, job.name, slot_ms)
            return
        delay_ms = self._random.randint(0, _ms(job.options.jitter) or 1)
        stage_ms = max(rank - 1, 0) * _ms(HEARTBEAT_INTERVAL)
        last_chance_ms = max(now_ms + lease_ms, last_ms - TAKE_OVER_GRAIN_MS)
        due_ms = min(now_ms + lease_ms + delay_ms + stage_ms, last_chance_ms)
        # Rounded up to TAKE_OVER_GRAIN_MS, so the checks of one round fall
        # due together and go to the backend as a few batches, not one each.
        due_ms = -(-due_ms // TAKE_OVER_GRAIN_MS) * TAKE_OVER_GRAIN_MS
        self._push_event(min(due_ms, last_ms), TAKE_OVER, job.name, slot_ms)

    def _check_take_overs_now(self) -> None:
        """A peer left the registry (hand-over on shutdown) or stopped
        heartbeating: check the slots this instance backs up at once
        instead of at lease expiry."""
        now_ms = self._now_ms()
        for name, slot_ms in self._take_over_due:
            self._push_event(now_ms, TAKE_OVER, name, slot_ms)

    def _peer_died(self, seen: Sequence[str]) -> bool:
        """True when a peer of ``seen`` (instance ids) has left the registry
        or stopped heartbeating (see :data:`PEER_STALE`) since."""
        live = set(self._peers)
        return any(peer not in live for peer in seen)

    def _take_over(self, due: Sequence[tuple[Job, int]], now_ms: int) -> None:
        """Check the ``(job, slot)`` take-overs due in this round with one
        batched call (:meth:`Backend.take_over_many`: slots already sent
        are answered from one read) and send the slots taken over. A slot
        whose lease another holder still has (``"held"``: maybe a backup
        that took it over) is checked again at that lease's end. A slot past
        ``max_late`` goes to :meth:`_record_lost_claims`. A check of a late
        rank (:data:`TAKE_OVER_RANKS`) is made only once a peer died, else
        moved a heartbeat period on, and dropped at ``max_late``. One the
        backend did not answer is checked again when the backend is retried
        (:meth:`_retry_take_overs`)."""
        assert self._settings is not None and self._backend is not None
        todo: list[tuple[Job, int]] = []
        late: list[tuple[Job, int]] = []
        for job, slot_ms in due:
            key = (job.name, slot_ms)
            if key not in self._take_over_due:
                continue  # settled by an earlier check
            last_ms = slot_ms + _ms(job.options.max_late)
            seen = self._take_over_gated.get(key)
            if seen is not None and not self._peer_died(seen):
                if now_ms + _ms(HEARTBEAT_INTERVAL) < last_ms:
                    self._push_event(now_ms + _ms(HEARTBEAT_INTERVAL), TAKE_OVER, *key)
                else:  # every peer it saw is alive: they check it
                    self._take_over_due.discard(key)
                    self._take_over_gated.pop(key, None)
                continue
            (late if now_ms > last_ms else todo).append((job, slot_ms))
        if late:
            self._record_lost_claims(late, now_ms)
        if not todo:
            return
        if not self._backend_ready:
            self._retry_take_overs(todo)
            return
        requests = [job.claim_request(slot, self._settings.max_skew) for job, slot in todo]
        claims = self._take_over_many(requests)
        if claims is None:
            self._retry_take_overs(todo)
            return
        claimed_at = self._clock()
        for (job, slot_ms), claim in zip(todo, claims, strict=True):
            if claim.reason == "unknown":
                self._retry_take_overs([(job, slot_ms)])
                continue
            if claim.reason == "held":
                self._plan_take_over(job, slot_ms, now_ms, again=True)
                continue
            self._take_over_due.discard((job.name, slot_ms))
            self._take_over_gated.pop((job.name, slot_ms), None)
            if claim.won:
                self.metrics.superseded(job.name)
                logger.warning(
                    "anarchon: took %s @ %s over from an owner whose lease ended (token %s)",
                    job.name,
                    _iso(slot_ms),
                    claim.token,
                )
                self._send(job, claim, claimed_at)

    def _retry_take_overs(self, due: Sequence[tuple[Job, int]]) -> None:
        """The backend did not answer these checks: check them again when it
        is retried (past ``max_late`` by then, they are recorded instead)."""
        retry_ms = max(int(self._retry_at * 1000), self._now_ms() + 1000)
        for job, slot_ms in due:
            self._push_event(retry_ms, TAKE_OVER, job.name, slot_ms)

    def _take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim] | None:
        """:meth:`Backend.take_over_many`, or None (logged) without a full answer."""
        assert self._backend is not None
        if not isinstance(self._backend, LeaseBackend):  # claim-only: never takes over
            return [Claim(r.job, r.slot_ms, won=False, reason="taken") for r in requests]
        try:
            claims = self._backend.take_over_many(requests)
        except BackendUnavailable as exc:
            self._on_outage(exc)
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

    def _record_lost_claims(self, due: Sequence[tuple[Job, int]], now_ms: int) -> None:
        """Slots past ``max_late`` that this instance backs up: one still
        ``claimed`` whose lease ended (its holder died before recording a
        send, maybe after publishing) is taken over (fenced, with a claim
        window reaching back to it) and recorded ``lost``, never sent; so
        the slot is on the record, and no later claim can take it. One whose
        holder's lease still runs is checked again at its end; the others
        (sent, recorded) are forgotten."""
        assert self._backend is not None
        if not self._backend_ready:
            self._retry_take_overs(due)
            return
        requests = [self._catch_up_request(job, slot_ms, now_ms) for job, slot_ms in due]
        claims = self._take_over_many(requests)
        if claims is None:
            self._retry_take_overs(due)
            return
        for (job, slot_ms), claim in zip(due, claims, strict=True):
            key = (job.name, slot_ms)
            if claim.reason == "unknown":
                self._retry_take_overs([(job, slot_ms)])
                continue
            if claim.reason == "held":
                retry_ms = now_ms + _ms(job.options.lease_ttl) + TAKE_OVER_GRAIN_MS
                self._push_event(retry_ms, TAKE_OVER, job.name, slot_ms)
                continue
            self._take_over_due.discard(key)
            self._take_over_gated.pop(key, None)
            if not claim.won:
                continue
            error = "its owner's lease ended before it recorded a send; past max_late"
            if self._mark(claim, State.LOST, error=error):
                self.metrics.missed(job.name, 1)
                logger.warning(
                    "anarchon: recorded %s @ %s lost: its owner's lease ended before it "
                    "recorded a send, and max_late=%ss has passed (token %s)",
                    job.name,
                    _iso(slot_ms),
                    job.options.max_late,
                    claim.token,
                )

    # -- overlap protection ------------------------------------------------

    def _skip_for_overlap(self, job: Job, slot_ms: int, claiming: dict[str, int]) -> bool:
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
            backend = self._backend
            if backend is None or not self._backend_ready:
                return False
            try:
                history = backend.history(job.name, limit=job.options.history_size)
            except BackendUnavailable as exc:
                self._on_outage(exc)
                return False
            runs = (r for r in history if r.slot_ms < slot_ms and r.state not in NOT_RUN)
            previous = next(runs, None)
            if previous is None or not self._in_flight(previous, job):
                claiming[job.name] = slot_ms
                return False
            previous_ms, state = previous.slot_ms, str(previous.state)
        if self._record_if_absent(job, slot_ms, State.SKIPPED, f"previous run {state}"):
            self.metrics.skipped(job.name)
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
        now_ms = self._now_ms()
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
                self._expires(job, run.slot_ms),
                run.sent_at_ms,
            )
            skew_ms = _ms(self._settings.max_skew) if self._settings is not None else 0
            return expiry_ms is None or expiry_ms + skew_ms > now_ms
        if run.state is State.RUNNING:
            if lease_alive:
                return True
            assert self._backend is not None
            token = run.token if isinstance(run.token, int) else None
            dead = Claim(run.job, run.slot_ms, won=True, token=token)
            if self._mark(dead, State.LOST, error="worker lease expired while running"):
                logger.warning(
                    "anarchon: run of %s @ %s was running but its lease ended: recorded lost",
                    job.name,
                    _iso(run.slot_ms),
                )
            return False
        return False

    # -- sending -----------------------------------------------------------

    def _send(self, job: Job, claim: Claim, claimed_at: float) -> None:
        """Send a won slot; record ``sent`` (or ``lost`` when the send fails).

        A claim held for more than half its lease (this process was frozen
        or slow) is checked against the backend before publishing: if its
        fencing token is no longer current, another instance took the slot
        over and nothing is sent.
        """
        assert self._settings is not None
        if self._settings.test_send_delay:  # fault injection, tests only
            time.sleep(self._settings.test_send_delay)
        lease_s = job.options.lease_ttl
        held_s = self._clock() - claimed_at
        if held_s > lease_s / 2 and (held_s > lease_s * 0.8 or not self._still_holds(claim)):
            # The lease has (nearly) ended: a backup may be taking the slot
            # over now. Publishing would risk a second publish; leave the
            # slot to the backup, recorded lost later if none sent it.
            self._held.pop((job.name, claim.slot_ms), None)
            logger.warning(
                "anarchon: %s @ %s held %.1fs of a %.0fs lease before its send; not sent "
                "by this instance (left to a backup)",
                job.name,
                _iso(claim.slot_ms),
                held_s,
                lease_s,
            )
            self._on_send_failed(
                job, claim, task_id_for(job.name, claim.slot_ms), TimeoutError("lease ended")
            )
            return
        task_id = task_id_for(job.name, claim.slot_ms)
        # Not released on shutdown from here on: a publish interrupted after
        # it reached the broker must fall to lease expiry (the documented
        # window, leaving a superseded record), never to a hand-over.
        self._held.pop((job.name, claim.slot_ms), None)
        try:
            self._publish(job, claim, claimed_at, task_id)
        except _StaleClaim as exc:
            logger.warning(
                "anarchon: %s @ %s held %.1fs of a %.0fs lease when its publish was due; "
                "not sent by this instance (left to a backup)",
                job.name,
                _iso(claim.slot_ms),
                exc.held_s,
                lease_s,
            )
            self._on_send_failed(job, claim, task_id, TimeoutError("lease ended"))
            return
        except _PublishInDoubt as exc:
            self.metrics.send_failed(job.name)
            self._on_publish_in_doubt(job, claim, task_id, exc.cause)
            return
        except Exception as exc:
            self.metrics.send_failed(job.name)
            self._on_send_failed(job, claim, task_id, exc)
            return
        self._held.pop((job.name, claim.slot_ms), None)
        self.metrics.won(job.name, self._clock() - claim.slot_ms / 1000)
        logger.info(
            "anarchon: sent %s @ %s (task %s, id %s, by %s)",
            job.name,
            _iso(claim.slot_ms),
            job.entry.task,
            task_id,
            self.instance_id,
        )
        self._record_sent(job, claim, task_id)

    def _on_send_failed(self, job: Job, claim: Claim, task_id: str, exc: Exception) -> None:
        """Sending a won slot failed (this instance cannot reach Celery's
        broker). On a lease backend the claim is left to expire, so a backup
        that can reach the broker takes the slot over and sends it; if none
        did by ``max_late``, this instance records it ``lost`` (fenced: a
        take-over leaves its record alone). A claim-only backend cannot hand
        the slot on: it is recorded ``lost`` at once."""
        error = f"send failed: {exc!r}"
        backend = self._backend
        if backend is None or not backend.supports_leases:
            logger.error(
                "anarchon: won %s @ %s but sending failed: %r; recorded as lost",
                job.name,
                _iso(claim.slot_ms),
                exc,
            )
            self._mark(claim, State.LOST, task_id=task_id, error=error)
            return
        logger.error(
            "anarchon: won %s @ %s but sending failed: %r; left for a backup instance "
            "to take over when the lease ends",
            job.name,
            _iso(claim.slot_ms),
            exc,
        )
        lease_end = self._now_ms() + _ms(job.options.lease_ttl)
        self._failed_sends[(job.name, claim.slot_ms)] = (claim, error, lease_end)
        last_chance = claim.slot_ms + _ms(job.options.max_late)
        self._push_event(max(lease_end, last_chance) + 1000, SEND_FAILED, job.name, claim.slot_ms)

    def _on_publish_in_doubt(self, job: Job, claim: Claim, task_id: str, exc: Exception) -> None:
        """A publish failed after it may have reached Celery's broker: the
        slot may be queued already. Recorded ``lost`` at once (DESIGN
        section 3: in doubt, never send twice), not left to a backup: a
        take-over would publish it a second time. The record closes the
        claim, so no backup takes it over; only when the backend does not
        take the record may a backup take the slot over at lease end."""
        error = f"publish failed after it may have reached the broker: {exc!r}"
        if self._mark(claim, State.LOST, task_id=task_id, error=error):
            logger.error(
                "anarchon: %s @ %s: publish failed after it may have reached the broker "
                "(%r); not sent again, recorded lost",
                job.name,
                _iso(claim.slot_ms),
                exc,
            )
        else:
            logger.error(
                "anarchon: %s @ %s: publish failed after it may have reached the broker "
                "(%r) and it could not be recorded lost; a backup may send it again "
                "when the lease ends",
                job.name,
                _iso(claim.slot_ms),
                exc,
            )

    def _close_failed_send(self, job: Job, slot_ms: int) -> None:
        """No backup took the slot over: record this instance's claim lost."""
        failed = self._failed_sends.pop((job.name, slot_ms), None)
        if failed is not None and self._mark(failed[0], State.LOST, error=failed[1]):
            logger.warning(
                "anarchon: %s @ %s: sending failed and no backup sent it; recorded lost",
                job.name,
                _iso(slot_ms),
            )

    # -- publishing to Celery's broker ---------------------------------------

    def _publish(self, job: Job, claim: Claim, claimed_at: float, task_id: str) -> None:
        """Publish a won slot, bounded in time so a tick is never blocked
        long by a broker that is away (DESIGN section 3: any doubt is lost).

        At most :data:`PUBLISH_ATTEMPTS` attempts. Each connects (once,
        bounded by ``broker_connection_timeout``) if beat has no broker
        connection, re-checks the claim's age right before publishing, and
        publishes without kombu's own retries. An attempt is repeated only
        when it certainly wrote nothing: the connection could not be made
        (connecting failed, or the publish was refused a connection). A
        publish that failed once it may have written (a connection reset or
        a timeout during or after the write) is never repeated: DESIGN
        section 3, in doubt never send twice. After a failed attempt the
        producer and its connection are dropped and made afresh: kombu
        closes the producer's channel when a publish hits a dropped
        connection and leaves it closed when it cannot reconnect, so the
        cached producer would fail every later publish
        (``AttributeError: 'NoneType' object has no attribute 'state'`` on
        the Redis transport) even once the broker is back.

        Raises:
            _StaleClaim: the claim was held more than :data:`PUBLISH_BY` of
                its lease when a publish was due (a backup may take it over).
            _PublishInDoubt: the publish failed after it may have reached
                the broker (not tried again).
            Exception: the last attempt's error, or, within
                :data:`PUBLISH_PAUSE` seconds of a failed publish, a
                ConnectionError without trying (the broker is away).
        """
        lease_s = job.options.lease_ttl
        if time.monotonic() < self._publish_paused_until:
            raise ConnectionError(
                f"Celery's broker did not answer a publish less than {PUBLISH_PAUSE:g}s "
                f"ago ({self._publish_error}); not tried again yet"
            )
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            may_have_written = False
            try:
                producer = self.producer  # connects if needed, bounded
                held_s = self._clock() - claimed_at
                if held_s > lease_s * PUBLISH_BY:
                    raise _StaleClaim(held_s)
                may_have_written = True  # from here on the message may reach the broker
                send_slot(
                    self.app,
                    job.entry,
                    job=job.name,
                    slot_ms=claim.slot_ms,
                    token=claim.token,
                    task_id=task_id,
                    producer=producer,
                    expires=self._expires(job, claim.slot_ms),
                    retry=False,
                )
                return
            except _StaleClaim:
                raise
            except Exception as exc:
                self._drop_producer()
                in_doubt = may_have_written and not _refused(exc)
                if in_doubt or attempt == PUBLISH_ATTEMPTS:
                    self._publish_error = repr(exc)
                    self._publish_paused_until = time.monotonic() + PUBLISH_PAUSE
                    if in_doubt:
                        raise _PublishInDoubt(exc) from exc
                    raise
                logger.info(
                    "anarchon: publishing %s @ %s failed (%r); again on a new broker connection",
                    job.name,
                    _iso(claim.slot_ms),
                    exc,
                )

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
        way and released by :meth:`close`). The Redis transport ignores
        ``broker_connection_timeout``: there it is also the connection's
        ``socket_connect_timeout`` and ``socket_timeout``, unless
        ``broker_transport_options`` sets them, so a broker that does not
        answer fails a publish after that long instead of blocking beat."""
        connection = self.app.connection_for_write()
        if connection.transport_cls not in REDIS_TRANSPORTS:
            return connection
        timeout = float(self.app.conf.broker_connection_timeout or 4.0)
        own = self.app.conf.broker_transport_options or {}
        options = {k: timeout for k in ("socket_connect_timeout", "socket_timeout") if k not in own}
        if not options:
            return connection
        connection.release()
        return self.app.connection_for_write(transport_options=options)

    def _ensure_connected(self) -> Any:
        """Connect beat's broker connection for :attr:`producer`: one
        attempt, bounded by the connection's timeout. (Celery's own retries
        ``broker_connection_max_retries`` times, 100 by default, with
        growing pauses: a tick blocked for many minutes by a broker outage.)

        Raises:
            kombu.exceptions.OperationalError: the broker did not answer.
        """
        return self.connection.ensure_connection(max_retries=0)

    def _expires(self, job: Job, slot_ms: int) -> datetime | None:
        """The message expiry of ``job``'s run at ``slot_ms`` (anarchon_expires)."""
        if job.options.expires is None:
            return None
        following = job.slots.next_after(slot_ms) if job.options.expires == "next_slot" else None
        return expires_for(job.options, slot_ms, following)

    def _still_holds(self, claim: Claim) -> bool:
        """True when ``claim`` is still held: its token is the slot's current
        one, the run is still ``claimed``, and its lease ends more than a
        tenth of the lease after the backend's now: one
        :meth:`Backend.holding` read (a key read, not the job's history);
        False when the backend does not answer. (A batch gives back what it
        could not send by a third of the lease, :meth:`_send_all`, so this is
        asked only of a send that stalled on its own.)"""
        if self._backend is None or not self._backend.supports_leases:
            return True
        return self._read_holding([claim])[0]

    def _read_holding(self, claims: Sequence[Claim]) -> list[bool]:
        """:meth:`Backend.holding` for ``claims``, with a margin of a tenth
        of the shortest lease; all False when the backend does not answer."""
        backend = self._backend
        if backend is None or not claims:
            return [False] * len(claims)
        if not isinstance(backend, LeaseBackend):  # claim-only: no lease to lose
            return [claim.won for claim in claims]
        leases = [self._jobs[c.job].options.lease_ttl for c in claims if c.job in self._jobs]
        margin_ms = _ms(min(leases, default=0.0) / 10)
        try:
            answers = backend.holding(claims, margin_ms)
        except BackendUnavailable as exc:
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: reading the leases of %d claim(s) failed", len(claims))
        else:
            if len(answers) == len(claims):
                return answers
        return [False] * len(claims)

    def _mark(self, claim: Claim, state: State, **fields: Any) -> bool:
        """Record ``state`` for ``claim`` (one call); True when written,
        False when refused (fenced) or not written (the backend did not
        answer: logged, and an outage begins)."""
        if self._backend is None:
            return False
        started = time.perf_counter()
        try:
            done = self._backend.mark(claim, state, **fields)
        except BackendUnavailable as exc:
            self.metrics.backend_error("mark")
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: recording %s for %s failed", state, claim.job)
        else:
            self.metrics.backend_call("mark", time.perf_counter() - started)
            return done
        return False

    def _record_sent(self, job: Job, claim: Claim, task_id: str) -> None:
        """Queue ``sent`` for a slot just published; the queue goes to the
        backend in chunks (:meth:`_flush_marks`) of :data:`MARK_CHUNK`, or
        once its oldest waited :data:`MARK_DELAY` seconds, and at the end
        of every batch. Until recorded, a mark is retried (a backend blip
        must not leave the slot ``claimed``, for a backup to take over and
        publish again) while a backup could still take the slot over: until
        the lease or the slot's claim window ends, whichever is later."""
        assert self._settings is not None
        o = job.options
        window_end = claim.slot_ms + _ms(o.max_late + o.jitter + self._settings.max_skew)
        until_ms = max(window_end, self._now_ms() + _ms(o.lease_ttl))
        if not self._unmarked:
            self._unmarked_since = time.monotonic()
        self._unmarked.append((job, claim, task_id, until_ms))
        if len(self._unmarked) > MAX_UNMARKED:
            dropped = self._unmarked[:-MAX_UNMARKED]
            del self._unmarked[:-MAX_UNMARKED]
            self._warn_unrecorded(dropped, "too many were waiting")
        ready = self._backend_ready and len(self._unmarked) >= MARK_CHUNK
        if ready or time.monotonic() - self._unmarked_since >= MARK_DELAY:
            self._flush_marks()

    def _flush_marks(self) -> None:
        """Record ``sent`` for the queued slots, :data:`MARK_CHUNK` per
        :meth:`Backend.mark_many` call. On an outage the rest stays queued
        and is retried at later ticks; a mark whose retry time passed is
        dropped with a warning. A refused mark (the slot was taken over
        meanwhile) is logged."""
        now_ms = self._now_ms()
        expired = [m for m in self._unmarked if m[3] < now_ms]
        if expired:
            self._unmarked = [m for m in self._unmarked if m[3] >= now_ms]
            self._warn_unrecorded(expired, "the backend did not answer in time")
        backend = self._backend
        while self._unmarked and backend is not None and self._backend_ready:
            chunk = self._unmarked[:MARK_CHUNK]
            started = time.perf_counter()
            try:
                answers = backend.mark_many(
                    [claim for _, claim, _, _ in chunk],
                    State.SENT,
                    task_ids=[task_id for _, _, task_id, _ in chunk],
                )
            except BackendUnavailable as exc:
                self.metrics.backend_error("mark")
                self._on_outage(exc)
                break
            except Exception:  # a bug, not an outage: logged, not retried
                logger.exception("anarchon: recording %d sent slot(s) failed", len(chunk))
                answers = [True] * len(chunk)
            else:
                self.metrics.backend_call("mark", time.perf_counter() - started)
            del self._unmarked[: len(chunk)]
            for (job, claim, _, _), done in zip(chunk, answers, strict=False):
                if not done:
                    logger.warning(
                        "anarchon: %s @ %s was taken over by another instance while this "
                        "one sent it; the worker integration discards the second delivery",
                        job.name,
                        _iso(claim.slot_ms),
                    )
        self._unmarked_since = time.monotonic()

    def _warn_unrecorded(self, marks: Sequence[tuple[Job, Claim, str, int]], why: str) -> None:
        logger.warning(
            "anarchon: %d sent slot(s) could not be recorded sent (%s), first %s @ %s; "
            "a backup instance may send them again",
            len(marks),
            why,
            marks[0][0].name,
            _iso(marks[0][1].slot_ms),
        )

    def _skip_missed(self, job: Job, slot_ms: int, now_ms: int) -> tuple[Job, list[int], int]:
        """Move ``job`` past ``slot_ms`` and every later slot already past
        ``max_late``, plan its next slot, and answer ``(job, slots, total)``
        for :meth:`_record_misses`: the newest :data:`MAX_MISSES_RECORDED`
        missed slots, to be recorded one by one, and how many were missed
        (counted up to :data:`MAX_MISSES_COUNTED`)."""
        late_ms = _ms(job.options.max_late)
        newest: collections.deque[int] = collections.deque(maxlen=MAX_MISSES_RECORDED)
        total = 0
        slot: int | None = slot_ms
        while slot is not None and now_ms > slot + late_ms and total < MAX_MISSES_COUNTED:
            newest.append(slot)
            total += 1
            slot = job.slots.next_after(slot)
        while slot is not None and now_ms > slot + late_ms:  # beyond the count: skip ahead
            slot = job.slots.next_after(max(slot, now_ms - late_ms))
        job.next_slot_ms = slot
        self._push(job)
        return job, list(newest), total

    def _record_misses(self, misses: Sequence[tuple[Job, list[int], int]]) -> None:
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
        answers = self._record_absent(records)
        written = collections.Counter(
            job.name for (job, _, _, _), ok in zip(records, answers, strict=True) if ok
        )
        for job, slots, total in misses:
            recorded = written[job.name]
            if not recorded:
                continue
            self.metrics.missed(job.name, recorded)
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

    def _record_if_absent(self, job: Job, slot_ms: int, state: State, error: str) -> bool:
        """Record ``state`` for one slot with no record (see
        :meth:`_record_absent`); whether it was written."""
        return self._record_absent([(job, slot_ms, state, error)])[0]

    def _record_absent(self, records: Sequence[tuple[Job, int, State, str]]) -> list[bool]:
        """Record ``(job, slot, state, error)`` where each slot has no record
        (``missed``, ``skipped``), :data:`RECORD_CHUNK` per backend call;
        whether each was written. While the backend is away, the rest wait
        in a queue (the newest :data:`MAX_UNRECORDED`) and are written when
        it is back (:meth:`_record_after_outage`)."""
        assert self._settings is not None
        answers = [False] * len(records)
        for start in range(0, len(records), RECORD_CHUNK):
            chunk = records[start : start + RECORD_CHUNK]
            if not self._backend_ready or self._backend is None:
                self._unrecorded.extend((j.name, slot, st, err) for j, slot, st, err in chunk)
                continue
            try:
                written = self._backend.record_many_if_absent(
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
                self._on_outage(exc)
                self._unrecorded.extend((j.name, slot, st, err) for j, slot, st, err in chunk)
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

    def _record_after_outage(self) -> None:
        """Write the records that could not be written while the backend was
        away (oldest first; the queue keeps the newest MAX_UNRECORDED)."""
        pending, self._unrecorded = list(self._unrecorded), collections.deque(maxlen=MAX_UNRECORDED)
        recorded = 0
        deadline = time.monotonic() + TICK_BUDGET / 2
        for start in range(0, len(pending), RECORD_CHUNK):
            if time.monotonic() > deadline or not self._backend_ready:
                # The rest in later ticks (or, away again, when it is back).
                self._unrecorded.extend(pending[start:])
                break
            chunk = [
                (self._jobs[name], slot_ms, state, error)
                for name, slot_ms, state, error in pending[start : start + RECORD_CHUNK]
                if name in self._jobs
            ]
            recorded += sum(self._record_absent(chunk))
        if recorded:
            logger.warning(
                "anarchon: recorded %d slot(s) missed while the backend was away", recorded
            )

    # -- backend connection and outages ------------------------------------

    def _connect(self) -> None:
        """Open the backend and probe it with one real round trip. Before
        start-up ends a ConfigurationError stops beat; after it, the problem
        (a Redis restarted with eviction, a changed password) is logged at
        every retry and beat keeps ticking, sending nothing unclaimed."""
        assert self._backend is not None
        try:
            self._backend.open()
            self._backend.now_ms()  # open() may answer from cache: probe for real
        except BackendUnavailable as exc:
            self._on_outage(exc)
            return
        except ConfigurationError as exc:
            if not self._setup_done:
                raise
            logger.critical("anarchon: claim backend refused on reconnect: %s", exc)
            self._on_outage(exc)
            return
        self._backend_ready = True
        self._on_success()

    def _on_outage(self, exc: BaseException) -> None:
        now = self._clock()
        if self._outage_since is None:
            self._outage_since = now
            self._backoff = BACKOFF_MIN
            logger.warning(
                "anarchon: claim backend %s is unavailable (%s); no slot is sent "
                "until it answers again. Retrying with backoff.",
                self._backend.describe() if self._backend else "?",
                exc,
            )
        else:
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self._backend_ready = False
        self._retry_at = now + self._backoff

    def _on_success(self) -> None:
        if self._outage_since is not None:
            logger.warning(
                "anarchon: claim backend is back after %.1fs; %d slot(s) were not "
                "sent by this instance meanwhile",
                self._clock() - self._outage_since,
                self._outage_lost,
            )
        self._outage_since = None
        self._outage_lost = 0
        self._backoff = BACKOFF_MIN

    def _heartbeat(self, now: float) -> None:
        """Refresh this instance in the registry, read the live instances
        (for rendezvous preference) and warn about definition drift."""
        assert self._backend is not None
        self._next_heartbeat = now + HEARTBEAT_INTERVAL
        if not self._backend.supports_leases:
            return
        info = self.instance_info()
        ttl_ms = _ms(registry_ttl(self.app.conf))
        try:
            # The definitions go with the first heartbeat of this schedule
            # only; later ones carry the fingerprint (constant cost per job
            # count). If the registry lost them (our entry expired), resend.
            sent = self._definitions_stored != info.fingerprint
            stored = self._backend.register(info if sent else _without_jobs(info), ttl_ms)
            if not stored and not sent:
                stored = self._backend.register(info, ttl_ms)
            self._definitions_stored = info.fingerprint if stored else None
            live = self._backend.instances()
        except BackendUnavailable as exc:
            self._on_outage(exc)
            return
        except Exception:
            logger.exception("anarchon: registry heartbeat failed")
            return
        # A peer that stopped heartbeating counts as dead before the registry
        # drops it (a beat killed with SIGKILL stays listed for registry_ttl).
        newest = max((info.heartbeat_ms for info in live), default=0)
        stale_ms = _ms(PEER_STALE)
        fresh = {info.instance for info in live if newest - info.heartbeat_ms <= stale_ms}
        peers = sorted(fresh | {self.instance_id})
        if set(self._peers) - set(peers):
            self._check_take_overs_now()
        self._peers = peers
        self._warn_drift(live)
        self._housekeep(now)

    def _housekeep(self, now: float) -> None:
        """Let the backend run the upkeep it left out of the claim path
        (SQL history trims), for at most :data:`HOUSEKEEPING_BUDGET`
        seconds, unless a slot falls due within that time."""
        assert self._backend is not None
        if self._events and self._events[0][0] < (now + HOUSEKEEPING_BUDGET) * 1000:
            return
        try:
            self._backend.housekeep(HOUSEKEEPING_BUDGET)
        except Exception:  # never let upkeep stop beat
            logger.exception("anarchon: backend housekeeping failed")

    def _warn_drift(self, live: Sequence[InstanceInfo]) -> None:
        """Warn once per job and instance whose definition differs from ours.

        A peer's definitions are read (:meth:`Backend.definitions`) only when
        its fingerprint differs from ours, and once per peer and fingerprint.
        Meanwhile each definition's slots are claimed on their own keys only
        when the slot times differ; where they agree, one claim still wins.
        """
        mine, fingerprint = self._schedule_definitions()
        for other in live:
            if other.instance == self.instance_id or other.fingerprint == fingerprint:
                continue
            if (other.instance, other.fingerprint) in self._drift_read:
                continue
            theirs_all = other.jobs or self._peer_definitions(other.instance)
            if not theirs_all:
                continue  # not stored yet: read again at the next heartbeat
            self._drift_read.add((other.instance, other.fingerprint))
            for name, theirs in theirs_all.items():
                ours = mine.get(name)
                if ours is None or ours == theirs:
                    continue
                seen = (name, other.instance, theirs)
                if seen not in self._drift_seen:
                    self._drift_seen.add(seen)
                    logger.warning(
                        "anarchon: job %s is defined differently on instance %s (a rolling "
                        "deploy?); slots both definitions share are still claimed once",
                        name,
                        other.instance,
                    )

    def _peer_definitions(self, instance: str) -> dict[str, str]:
        """A peer's stored definitions; empty when they cannot be read."""
        assert self._backend is not None
        try:
            return self._backend.definitions(instance)
        except BackendUnavailable as exc:
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: reading the definitions of %s failed", instance)
        return {}

    def _schedule_definitions(self) -> tuple[dict[str, str], str]:
        """``({job: definition hash}, fingerprint)`` of the jobs this
        instance runs, computed once per schedule (the jobs mapping built at
        set-up), not at every heartbeat."""
        cached = self._definitions_cache
        if cached is None or cached[0] is not self._jobs:
            jobs = {name: job.definition for name, job in self._jobs.items()}
            fingerprint = hashlib.sha1(
                "\x00".join(f"{k}={v}" for k, v in sorted(jobs.items())).encode()
            ).hexdigest()[:12]
            cached = self._definitions_cache = (self._jobs, jobs, fingerprint)
        return cached[1], cached[2]

    def instance_info(self) -> InstanceInfo:
        """This instance as the registry keeps it, with its definitions
        (``jobs``, shared with this scheduler: do not change it); the
        heartbeat sends them only when the registry lacks them."""
        jobs, fingerprint = self._schedule_definitions()
        host, pid, _ = self.instance_id.rsplit(":", 2)
        return InstanceInfo(
            instance=self.instance_id,
            host=host,
            pid=int(pid),
            version=__version__,
            started_ms=self._started_ms,
            heartbeat_ms=self._now_ms(),
            clock_ms=self._now_ms(),
            fingerprint=fingerprint,
            jobs=jobs,
        )

    # -- Celery hooks ------------------------------------------------------

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
            backend = self._backend
            pending = self._unmarked or self._held or self._failed_sends
            if backend is not None and not self._backend_ready and pending:
                try:
                    self._connect()
                except Exception as exc:  # a ConfigurationError before start-up ended
                    logger.warning("anarchon: could not reconnect on shutdown: %r", exc)
            if backend is not None and self._backend_ready:
                self._flush_marks()
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
            self._backend_ready = False
            self.metrics.close()
        super().close()

    def _hand_over(self, backend: Backend) -> None:
        """On graceful shutdown, give up the claims this instance won and
        has not sent, each either to another instance or to the record.

        A held claim (won, not yet published) whose slot another instance
        can still take within ``max_late`` (at least :data:`HAND_OVER_MARGIN`
        seconds left: the others see this instance leave the registry at
        their next heartbeat) is released, so one takes it at once instead
        of after the lease; a later one is recorded ``lost`` with the
        reason, since nobody could send it any more and a released slot has
        no record. A claim whose send failed stays with its lease while a
        backup can still take it over: its lease ends before ``max_late``,
        or it has ended already with at least :data:`HAND_OVER_MARGIN`
        seconds left before ``max_late`` (the backups' checks are due);
        otherwise it is recorded ``lost`` now (this instance will not be
        there to do it when ``max_late`` ends). Records are fenced by token: a slot taken
        over meanwhile keeps the new owner's record."""
        now_ms = self._now_ms()
        release: list[Claim] = []
        lost: list[tuple[Claim, str]] = []
        for claim in self._held.values():
            job = self._jobs.get(claim.job)
            if job is None:
                continue
            last_ms = claim.slot_ms + _ms(job.options.max_late)
            if now_ms + _ms(HAND_OVER_MARGIN) <= last_ms:
                release.append(claim)
            else:
                lost.append((claim, "shut down before sending; too late to hand over"))
        self._held = {}
        for (name, slot_ms), (claim, error, lease_end_ms) in self._failed_sends.items():
            job = self._jobs.get(name)
            if job is None:
                continue
            last_ms = slot_ms + _ms(job.options.max_late)
            if lease_end_ms > last_ms:
                backup_can_take = False  # the lease outlives max_late
            elif now_ms < lease_end_ms:
                backup_can_take = True  # a backup checks at the lease's end
            else:  # the lease ended: a backup's check is due now, or at its next heartbeat
                backup_can_take = now_ms + _ms(HAND_OVER_MARGIN) <= last_ms
            if not backup_can_take:
                lost.append((claim, f"{error}; shut down, no backup took it over"))
        self._failed_sends = {}
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
            backend = self._backend or backend_from_url(
                settings.backend,
                instance=self.instance_id,
                options=settings.effective_backend_options(),
                client=settings.backend_client,
            )
            where = backend.describe()
        except ConfigurationError as exc:
            where = f"misconfigured: {exc}"
        jobs = len(self._jobs) or len(self.app.conf.beat_schedule or {})
        return f"    . anarchon -> {where}, {jobs} job(s)"

    # -- helpers -----------------------------------------------------------

    @property
    def jobs(self) -> Mapping[str, Job]:
        """The jobs this scheduler runs, by name."""
        return self._jobs

    @property
    def backend(self) -> Backend | None:
        """The claim backend (None before set-up)."""
        return self._backend

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)


def _without_jobs(info: InstanceInfo) -> InstanceInfo:
    """``info`` without its definitions: a heartbeat's payload."""
    return dataclasses.replace(info, jobs={})


def _average(old: float | None, sample: float) -> float:
    """A cost's new estimate: the sample when it is higher (or the first),
    else the mean of the old estimate and the sample."""
    return sample if old is None or sample > old else (old + sample) / 2


def _iso(ms: int) -> str:
    """``ms`` (epoch milliseconds) as an ISO 8601 UTC string for logs."""
    stamp = datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")
