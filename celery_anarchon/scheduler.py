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
from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from . import __version__
from .backends import backend_from_url, scheme_of
from .backends.base import Backend, Claim, ClaimRequest, InstanceInfo, State
from .exceptions import BackendUnavailable, ConfigurationError
from .metrics import Metrics, metrics_from_app
from .settings import JobOptions, Settings
from .slots import Slots, cron, definition, first_slot, oneoff, slots_for

__all__ = ["Entry", "Job", "Scheduler", "build_jobs", "send_slot", "task_id_for"]

logger = logging.getLogger(__name__)

#: Namespace of the task ids derived from ``(job, slot)``.
TASK_ID_NAMESPACE = uuid.UUID("6b3f4a52-2d0e-4c1e-9a55-0d1f3c7e8a90")

#: Extra time a claim record is kept after the last instant a late instance
#: could still try it, milliseconds.
KEEP_MARGIN_MS = 60_000

#: Registry heartbeat period and time-to-live, seconds.
HEARTBEAT_INTERVAL = 5.0
REGISTRY_TTL = 30.0

#: Reconnect backoff bounds while the backend is away, seconds.
BACKOFF_MIN = 1.0
BACKOFF_MAX = 30.0

#: Longest a tick keeps taking rounds of due slots before returning, seconds.
TICK_BUDGET = 1.0

#: Most missed slots of one job recorded one by one after a long stall; the
#: rest are counted in the log line.
MAX_MISSES_RECORDED = 100


def task_id_for(job: str, slot_ms: int) -> str:
    """The Celery task id of ``job``'s run at ``slot_ms``: the same on every
    host, so a second publish of one slot carries the same id."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{job}\x00{slot_ms}"))


def manual_task_id(job: str, key: str) -> str:
    """The task id of a ``run_now`` of ``job`` under ``key``."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{job}\x00manual\x00{key}"))


def new_instance_id() -> str:
    """``host:pid:random``, unique per scheduler process."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


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
    for name, entry in entries.items():
        overrides = getattr(entry, "anarchon", None)
        options = settings.job_options(name, overrides)
        slots = slots_for(entry.schedule, job=name, tz=zone, anchor_ms=options.anchor_ms)
        text = "\x00".join(
            [
                definition(entry.schedule, zone, options.anchor_ms),
                str(entry.task),
                repr(entry.args),
                repr(sorted((entry.kwargs or {}).items())),
            ]
        )
        jobs[name] = Job(name, entry, slots, options, hashlib.sha1(text.encode()).hexdigest()[:12])
    return jobs


def send_slot(
    app: Any,
    entry: beat.ScheduleEntry,
    *,
    job: str,
    slot_ms: int,
    token: int | str | None,
    task_id: str,
    producer: Any = None,
) -> Any:
    """Send ``entry``'s task for one slot through Celery's own path.

    ``apply_async`` with the entry's args, kwargs and options (routing,
    queue, expires, ...) untouched, plus the task id and the headers
    ``anarchon_job``, ``anarchon_slot`` (epoch ms), ``anarchon_token`` and
    Celery beat's own ``celery_beat_task``.

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
        self._events: list[tuple[int, int, str, int]] = []
        self._seq = 0
        self._started_ms = 0
        self._next_heartbeat = 0.0
        self._outage_since: float | None = None
        self._outage_lost = 0
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN
        self._closed = False
        self._random = random.Random()
        self.metrics: Metrics = Metrics()
        super().__init__(app, *args, **kwargs)

    # -- set-up ------------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read settings, validate every job, connect, and plan first slots.

        Raises:
            ConfigurationError: any bad setting, schedule or backend URL.
        """
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        self._settings = Settings.from_app(self.app, schedule_filename=self.schedule_filename)
        if self._backend is None:
            self._backend = backend_from_url(
                self._settings.backend,
                instance=self.instance_id,
                options=self._backend_options(self._settings),
                client=self._settings.backend_client,
            )
        self._jobs = build_jobs(self.schedule, self._settings, app_zone(self.app))
        for job in self._jobs.values():
            self._check_backend_supports(job)
        self._warn_if_local_only()
        self.metrics = metrics_from_app(self.app)
        self._started_ms = self._now_ms()
        self._connect()
        self._plan_first_slots()

    def _backend_options(self, settings: Settings) -> dict[str, Any]:
        options = dict(settings.backend_options)
        url = settings.backend or ""
        if settings.allow_eviction and scheme_of(url) in {
            "redis",
            "rediss",
            "redis+sentinel",
            "sentinel",
        }:
            options.setdefault("allow_eviction", True)
        return options

    def _check_backend_supports(self, job: Job) -> None:
        backend = self._backend
        assert backend is not None and self._settings is not None
        if backend.supports_leases:
            return
        o = job.options
        asked = []
        if "lease_ttl" in self._settings.explicit or "lease_ttl" in job.entry.anarchon:
            asked.append("lease_ttl (backup runners)")
        if o.overlap == "skip":
            asked.append("overlap='skip'")
        if o.catch_up != "none":
            asked.append(f"catch_up={o.catch_up!r}")
        if "history_ttl" in self._settings.explicit or "history_ttl" in job.entry.anarchon:
            asked.append("history_ttl (RabbitMQ history is trimmed by size only)")
        if asked:
            raise ConfigurationError(
                f"job {job.name!r}: {', '.join(asked)} need a lease backend; "
                f"{backend.describe()} is claim-only. Remove the setting, or set "
                "anarchon_backend to Redis, PostgreSQL or SQLite."
            )
        check = getattr(backend, "check_job", None)
        if check is not None:
            check(
                job.name,
                jitter_s=o.jitter,
                max_late_s=o.max_late,
                max_skew_s=self._settings.max_skew,
            )

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
        now_ms = self._now_ms()
        self._events = []
        for job in self._jobs.values():
            job.next_slot_ms = first_slot(job.slots, now_ms, _ms(job.options.max_late))
            self._push(job)

    # -- the heap ----------------------------------------------------------

    def _push(self, job: Job) -> None:
        """Schedule the claim of ``job``'s next slot at slot + a random delay
        in ``[0, jitter]`` (never slept in the tick)."""
        if job.next_slot_ms is None:
            return
        delay_ms = int(self._random.uniform(0, job.options.jitter) * 1000)
        self._seq += 1
        heapq.heappush(
            self._events, (job.next_slot_ms + delay_ms, self._seq, job.name, job.next_slot_ms)
        )

    def _pop_due(self, now_ms: int) -> list[tuple[Job, int]]:
        due = []
        while self._events and self._events[0][0] <= now_ms:
            _, _, name, slot_ms = heapq.heappop(self._events)
            job = self._jobs.get(name)
            if job is not None and job.next_slot_ms == slot_ms:
                due.append((job, slot_ms))
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
        """
        if self._settings is None:  # constructed lazily, then ticked
            self.setup_schedule()
        now = self._clock()
        if not self._backend_ready and now >= self._retry_at:
            self._connect()
        if self._backend_ready and now >= self._next_heartbeat:
            self._heartbeat(now)
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
        return wait

    def _process(self, due: Sequence[tuple[Job, int]]) -> None:
        assert self._settings is not None
        now_ms = self._now_ms()
        to_claim: list[tuple[Job, int]] = []
        for job, slot_ms in due:
            if now_ms > slot_ms + _ms(job.options.max_late):
                self._record_missed(job, slot_ms, now_ms)
            else:
                to_claim.append((job, slot_ms))
                self._advance(job, slot_ms)
        if to_claim:
            for (job, _), claim in zip(to_claim, self._claim(to_claim), strict=True):
                if claim.won:
                    self._send(job, claim)
                else:
                    self.metrics.lost(job.name)
                    logger.debug(
                        "anarchon: lost %s @ %s (%s)", job.name, _iso(claim.slot_ms), claim.reason
                    )

    def _claim(self, due: Sequence[tuple[Job, int]]) -> list[Claim]:
        assert self._settings is not None
        lost = [Claim(job.name, slot_ms, won=False, reason="unknown") for job, slot_ms in due]
        if not self._backend_ready or self._backend is None:
            self._outage_lost += len(due)
            return lost
        requests = [job.claim_request(slot_ms, self._settings.max_skew) for job, slot_ms in due]
        started = time.perf_counter()
        try:
            claims = self._backend.claim(requests)
        except BackendUnavailable as exc:
            self.metrics.backend_error("claim")
            self._on_outage(exc)
            self._outage_lost += len(due)
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

    def _send(self, job: Job, claim: Claim) -> None:
        task_id = task_id_for(job.name, claim.slot_ms)
        try:
            send_slot(
                self.app,
                job.entry,
                job=job.name,
                slot_ms=claim.slot_ms,
                token=claim.token,
                task_id=task_id,
                producer=self.producer,
            )
        except Exception as exc:
            logger.error(
                "anarchon: won %s @ %s but sending failed: %r; recorded as lost",
                job.name,
                _iso(claim.slot_ms),
                exc,
            )
            self._mark(claim, State.LOST, task_id=task_id, error=f"send failed: {exc!r}")
            self.metrics.send_failed(job.name)
            return
        self.metrics.won(job.name, self._clock() - claim.slot_ms / 1000)
        logger.info(
            "anarchon: sent %s @ %s (task %s, id %s)",
            job.name,
            _iso(claim.slot_ms),
            job.entry.task,
            task_id,
        )
        if not self._mark(claim, State.SENT, task_id=task_id):
            logger.warning(
                "anarchon: %s @ %s was taken over by another instance while this one "
                "sent it; the worker integration discards the second delivery",
                job.name,
                _iso(claim.slot_ms),
            )

    def _mark(self, claim: Claim, state: State, **fields: Any) -> bool:
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
        return True

    def _record_missed(self, job: Job, slot_ms: int, now_ms: int) -> None:
        """Record ``slot_ms`` and every later slot already past ``max_late``
        as missed (where nobody else acted on them), then plan the next one."""
        assert self._settings is not None
        late_ms = _ms(job.options.max_late)
        missed: list[int] = []
        skipped = 0
        slot: int | None = slot_ms
        while slot is not None and now_ms > slot + late_ms:
            if len(missed) < MAX_MISSES_RECORDED:
                missed.append(slot)
            else:
                skipped += 1
                if skipped > 1_000_000:  # a bounded loop, even for a 1 ms interval
                    break
            slot = job.slots.next_after(slot)
        job.next_slot_ms = slot
        self._push(job)
        recorded = 0
        for slot in missed[-job.options.history_size :]:
            if self._record_if_absent(job, slot, State.MISSED, "later than max_late"):
                recorded += 1
        if recorded or skipped:
            self.metrics.missed(job.name, recorded + skipped)
            logger.warning(
                "anarchon: missed %d slot(s) of %s (last %s): this instance was more "
                "than max_late=%ss behind%s",
                recorded + skipped,
                job.name,
                _iso(missed[-1]),
                job.options.max_late,
                f"; {skipped} older ones not recorded one by one" if skipped else "",
            )

    def _record_if_absent(self, job: Job, slot_ms: int, state: State, error: str) -> bool:
        assert self._settings is not None
        if not self._backend_ready or self._backend is None:
            return False
        try:
            return self._backend.record_if_absent(
                job.name,
                slot_ms,
                state,
                error=error,
                history_size=job.options.history_size,
                history_ttl_ms=_ms(job.options.history_ttl),
                keep_until_ms=job.keep_until_ms(slot_ms, self._settings.max_skew),
            )
        except BackendUnavailable as exc:
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: recording %s for %s failed", state, job.name)
        return False

    # -- backend connection and outages ------------------------------------

    def _connect(self) -> None:
        assert self._backend is not None
        try:
            self._backend.open()
        except BackendUnavailable as exc:
            self._on_outage(exc)
            return
        self._backend_ready = True
        self._on_success()

    def _on_outage(self, exc: BaseException) -> None:
        now = self._clock()
        if self._outage_since is None:
            self._outage_since = now
            self._backoff = BACKOFF_MIN
            logger.error(
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
        assert self._backend is not None
        self._next_heartbeat = now + HEARTBEAT_INTERVAL
        try:
            self._backend.register(self.instance_info(), _ms(REGISTRY_TTL))
        except BackendUnavailable as exc:
            self._on_outage(exc)
        except Exception:
            logger.exception("anarchon: registry heartbeat failed")

    def instance_info(self) -> InstanceInfo:
        """This instance as the registry keeps it."""
        jobs = {name: job.definition for name, job in self._jobs.items()}
        fingerprint = hashlib.sha1(
            "\x00".join(f"{k}={v}" for k, v in sorted(jobs.items())).encode()
        ).hexdigest()[:12]
        host, pid, _ = self.instance_id.rsplit(":", 2)
        return InstanceInfo(
            instance=self.instance_id,
            host=host,
            pid=int(pid),
            version=__version__,
            started_ms=self._started_ms,
            heartbeat_ms=self._now_ms(),
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
        """Leave the registry and close the backend. Safe to call twice."""
        if not self._closed:
            self._closed = True
            backend = self._backend
            if backend is not None and self._backend_ready:
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
                options=self._backend_options(settings),
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


def _iso(ms: int) -> str:
    """``ms`` (epoch milliseconds) as an ISO 8601 UTC string for logs."""
    stamp = datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")
