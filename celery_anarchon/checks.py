"""Validation of the configuration: what beat checks at start-up and what
``celery anarchon check`` reports.

One collector (:func:`run_check`) builds every job as beat would and the
backend without connecting (or, asked, connecting), and records each
problem instead of raising at the first: the CLI prints them, and beat
(:meth:`celery_anarchon.beat.scheduler.Scheduler.setup_schedule`) logs them
all before it stops. :func:`check_backend_supports` refuses a job whose
options need what the backend cannot give, for both.
"""

from __future__ import annotations

import difflib
import inspect
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat
from kombu.serialization import dumps

from .backends import backend_from_settings, backend_from_url, sanitize_url
from .backends.base import Backend
from .beat.registry import registry_ttl
from .delayed.settings import DelayedSettings
from .exceptions import BackendUnavailable, ConfigurationError
from .metrics import metrics_config
from .model import Entry, Job, app_zone, build_jobs, missing_key
from .settings import Settings, is_anarchon_key

__all__ = [
    "ENTRY_KEYS",
    "CheckResult",
    "Probe",
    "args_problem",
    "check_backend_supports",
    "one_line",
    "has_clock",
    "probe_backend",
    "run_check",
]

#: Keys a ``beat_schedule`` entry may have (those of the scheduler's Entry).
ENTRY_KEYS = frozenset(inspect.signature(Entry.__init__).parameters) - {"self", "name", "app"}


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, credentials masked."""
    lines = str(exc).strip().splitlines()
    return sanitize_url(lines[0] if lines else type(exc).__name__)


def check_backend_supports(backend: Backend, settings: Settings, job: Job) -> None:
    """Refuse a job whose options need what ``backend`` cannot give.

    Raises:
        ConfigurationError: on a claim-only backend (RabbitMQ), a job asking
            for ``lease_ttl``, ``overlap='skip'``, a catch-up policy, an
            explicit ``history_ttl`` or ``max_runs``; or the backend's own check of the job
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
    if o.max_runs is not None:
        asked.append("max_runs (the run count is kept with the leases)")
    if asked:
        raise ConfigurationError(
            f"job {job.name!r}: {', '.join(asked)} need a lease backend; "
            f"{backend.describe()} is claim-only. Remove the setting, or set "
            "anarchon_backend to Redis, PostgreSQL, MySQL or SQLite."
        )
    backend.check_job(
        job.name, jitter_s=o.jitter, max_late_s=o.max_late, max_skew_s=settings.max_skew
    )


def args_problem(
    app: Any,
    name: str,
    entry: beat.ScheduleEntry,
    seen: dict[tuple[Any, ...], Any] | None = None,
) -> str | None:
    """Why ``entry``'s args and kwargs cannot be sent, or None: they are
    checked once against the task's signature (a task registered in this
    process, under Celery's ``strict_typing``), then encoded once with the
    serializer their publish uses (the entry's ``options['serializer']``,
    else its task's, else ``task_serializer``). Beat logs the same text at
    start-up and records each of the job's slots ``lost`` with the error;
    ``check`` reports it. Lazy values (``BeatLazyFunc``) are evaluated only
    when sent, so an entry holding one is not checked. ``seen`` (a dict the
    caller keeps over many entries) remembers each distinct task, serializer,
    args and kwargs, so 100,000 entries with the same arguments are encoded
    once."""
    options = entry.options or {}
    task = app.tasks.get(entry.task) if entry.task else None
    serializer = options.get("serializer") or getattr(task, "serializer", None)
    if not serializer:
        # Celery's conf lookups cost ~20 us each: read it once per ``seen``
        if seen is None:
            serializer = app.conf.task_serializer
        else:
            if ("task_serializer",) not in seen:
                seen[("task_serializer",)] = app.conf.task_serializer
            serializer = seen[("task_serializer",)]
    args, kwargs = list(entry.args or ()), dict(entry.kwargs or {})
    if any(isinstance(v, beat.BeatLazyFunc) for v in [*args, *kwargs.values()]):
        return None
    key = (entry.task, serializer, repr(args), repr(sorted(kwargs.items())))
    if seen is not None and key in seen:
        fault = seen[key]
    else:
        fault = _args_fault(task, serializer, args, kwargs)
        if seen is not None:
            seen[key] = fault
    if fault is None:
        return None
    kind, detail = fault
    if kind == "signature":
        return (
            f"beat_schedule[{name!r}]: task {entry.task!r} does not take its args or "
            f"kwargs ({detail}); every slot of it would be recorded lost. Fix: give the args "
            "and kwargs the task's signature takes."
        )
    return (
        f"beat_schedule[{name!r}]: the serializer {serializer!r} refuses its args or "
        f"kwargs ({detail}); every slot of it would be "
        "recorded lost. Fix: give args and kwargs that serializer can encode (for "
        "'json': strings, numbers, booleans, None, lists and dicts, e.g. an id the task "
        "looks up), or set the entry's options={'serializer': ...} to one that can."
    )


def _args_fault(
    task: Any, serializer: str, args: list[Any], kwargs: dict[str, Any]
) -> tuple[str, str] | None:
    """``('signature', why)``, ``('serializer', why)`` or None (see
    :func:`args_problem`)."""
    header = getattr(task, "__header__", None) if getattr(task, "typing", False) else None
    if header is not None:
        try:
            header(*args, **kwargs)
        except TypeError as exc:
            return "signature", str(exc)
    try:
        dumps((args, kwargs), serializer=serializer)
    except Exception as exc:
        return "serializer", f"{type(exc).__name__}: {one_line(exc)}"
    return None


@dataclass
class Probe:
    """What ``status`` and ``check --connect`` measured of the backend (milliseconds)."""

    connect_ms: float
    rtt_ms: float | None = None
    backend_now_ms: int | None = None
    host_offset_ms: float | None = None


def has_clock(backend: Backend) -> bool:
    """True when the backend judges time by a clock of its own (Redis
    ``TIME``, the database's clock); SQLite and RabbitMQ use each host's."""
    return backend.supports_leases and backend.kind != "sqlite"


def probe_backend(backend: Backend) -> Probe:
    """Connect, then read the backend clock three times; keep the sample
    with the shortest round trip (as NTP does)."""
    started = time.perf_counter()
    backend.open()
    probe = Probe(connect_ms=(time.perf_counter() - started) * 1000)
    if not has_clock(backend):
        return probe
    for _ in range(3):
        local_s, before = time.time(), time.perf_counter()
        backend_now = backend.now_ms()
        rtt_s = time.perf_counter() - before
        if probe.rtt_ms is None or rtt_s * 1000 < probe.rtt_ms:
            probe.rtt_ms = rtt_s * 1000
            probe.backend_now_ms = backend_now
            probe.host_offset_ms = (local_s + rtt_s / 2) * 1000 - backend_now
    return probe


@dataclass
class CheckResult:
    """What ``check`` found: problems (exit 1) and warnings (exit 0).

    Attributes:
        backend: the claim backend, credentials masked (None: not built).
        delayed_backend: the backend that keeps parked tasks
            (``anarchon_delayed_backend``, else the claim backend),
            credentials masked; None when the set-up keeps none (a warning
            says why) or it could not be built (a problem says why).
    """

    problems: list[dict[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    jobs: int = 0
    backend: str | None = None
    connected: bool = False
    unreachable: bool = False
    delayed_backend: str | None = None

    def problem(self, where: str, message: str) -> None:
        self.problems.append({"where": where, "message": sanitize_url(message)})


def run_check(app: Any, schedule_filename: str | None, connect: bool) -> CheckResult:
    """Every start-up check beat makes, each problem recorded, none raised."""
    result = CheckResult()
    try:
        settings: Settings | None = Settings.from_app(app, schedule_filename=schedule_filename)
    except ConfigurationError as exc:
        result.problem("settings", str(exc))
        settings = None
    for where, validate in (
        ("anarchon_registry_ttl", lambda: registry_ttl(app.conf)),
        ("anarchon_metrics_port", lambda: metrics_config(app.conf)),
        ("anarchon_park_countdown_over", lambda: _parking_settings(app)),
    ):
        try:
            validate()
        except ConfigurationError as exc:
            result.problem(where, str(exc))
    try:
        delayed: DelayedSettings | None = DelayedSettings.from_app(app)
    except ConfigurationError as exc:
        result.problem("anarchon_delayed_*", str(exc))
        delayed = None
    try:
        zone = app_zone(app)
    except ConfigurationError as exc:
        result.problem("timezone", str(exc))
        result.warnings.append("jobs were not checked: Celery cannot build them without a zone")
        jobs: dict[str, Job] = {}
    else:
        jobs = _check_jobs(app, settings, zone, result)
    result.jobs = len(jobs)
    if settings is None:
        _check_backend_url(app, result)
        return result
    backend = _check_backend(app, settings, schedule_filename, jobs, result)
    if backend is not None and connect:
        _check_connect(backend, settings, result)
    if delayed is not None:
        _check_delayed(settings, delayed, connect, result)
    return result


def _parking_settings(app: Any) -> None:
    """Read the transparent parking settings (raises ConfigurationError)."""
    from .delayed.parking import ParkingSettings

    ParkingSettings.from_app(app)


def _check_delayed(
    settings: Settings, delayed: DelayedSettings, connect: bool, result: CheckResult
) -> None:
    """The backend that keeps parked tasks, as ``park`` and beat build it:
    ``anarchon_delayed_backend`` (its URL checked, and with ``connect`` it is
    reached when it is not the claim backend), else the claim backend. A
    set-up that keeps no delayed tasks (claims on RabbitMQ, no
    ``anarchon_delayed_backend``) is a warning: beat runs, ``park`` refuses."""
    from .delayed import delayed_backend, delayed_off, store_in

    off = delayed_off(settings, delayed)
    if off is not None:
        result.warnings.append(off)
        return
    try:
        backend = delayed_backend(settings, delayed, instance="anarchon-check")
        store = store_in(backend, delayed)
    except ConfigurationError as exc:
        if delayed.backend is not None:
            result.problem("anarchon_delayed_backend", str(exc))
        return  # else: the claim backend keeps none, or its own problem is reported
    result.delayed_backend = backend.describe()
    if not connect or delayed.backend is None:
        return
    try:
        backend.open()
    except BackendUnavailable as exc:
        result.unreachable = True
        result.problem("anarchon_delayed_backend", f"unreachable: {one_line(exc)}")
    except ConfigurationError as exc:
        result.problem("anarchon_delayed_backend", str(exc))
    finally:
        store.close()


def _check_jobs(
    app: Any, settings: Settings | None, zone: ZoneInfo, result: CheckResult
) -> dict[str, Job]:
    """Build each entry's job on its own, so that one bad entry does not
    hide the next; with broken global settings, against the defaults."""
    entries = _check_entries(app, result)
    if settings is None:
        result.warnings.append(
            "jobs were checked with the default anarchon_* settings until the settings "
            "above are fixed"
        )
    job_settings = settings or Settings.from_app(_DefaultsOnly(app))
    jobs: dict[str, Job] = {}
    for name, entry in entries.items():
        try:
            jobs.update(build_jobs({name: entry}, job_settings, zone))
        except ConfigurationError as exc:
            result.problem(f"beat_schedule[{name!r}]", str(exc))
            continue
        except Exception as exc:  # a schedule object that fails in its own way
            result.problem(f"beat_schedule[{name!r}]", f"{type(exc).__name__}: {exc}")
            continue
        problem = args_problem(app, name, entry)
        if problem is not None:
            result.problem(f"beat_schedule[{name!r}]", problem)
    return jobs


class _DefaultsOnly:
    """An app stand-in whose ``anarchon_*`` settings are all unset, so jobs
    can still be checked when the global settings are broken."""

    def __init__(self, app: Any) -> None:
        self.conf = {key: value for key, value in app.conf.items() if not is_anarchon_key(key)}


def _check_entries(app: Any, result: CheckResult) -> dict[str, Entry]:
    """Each ``beat_schedule`` entry as the scheduler builds it; problems
    recorded for entries that cannot be built."""
    schedule = app.conf.beat_schedule or {}
    entries: dict[str, Entry] = {}
    allowed = ", ".join(sorted(ENTRY_KEYS))
    for name, spec in schedule.items():
        where = f"beat_schedule[{name!r}]"
        if not isinstance(spec, Mapping):
            result.problem(where, f"{where} must be a dict of {allowed}; got {spec!r}.")
            continue
        unknown = sorted(set(spec) - ENTRY_KEYS)
        meant = set()  # keys the typos above probably meant
        for key in unknown:
            close = difflib.get_close_matches(key, ENTRY_KEYS, n=1)
            meant.update(close)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            result.problem(where, f"{where}: unknown key {key!r}.{hint} Allowed: {allowed}.")
        missing = [
            key for key in ("task", "schedule") if spec.get(key) is None and key not in meant
        ]
        for key in missing:
            result.problem(where, missing_key(name, key))
        if unknown or missing:
            continue
        try:
            entries[name] = Entry(**dict(spec, name=name, app=app))
        except ConfigurationError as exc:
            result.problem(where, str(exc))
        except Exception as exc:
            result.problem(where, f"{where}: {type(exc).__name__}: {exc}")
    return entries


def _check_backend(
    app: Any,
    settings: Settings,
    schedule_filename: str | None,
    jobs: Mapping[str, Job],
    result: CheckResult,
) -> Backend | None:
    """Build the backend as beat would (no connection) and check each job
    against what it supports. Uses the scheduler's own start-up checks so
    that ``check`` refuses exactly what beat refuses."""
    try:
        backend = backend_from_settings(settings, instance="anarchon-check")
    except ConfigurationError as exc:
        result.problem("anarchon_backend", str(exc))
        return None
    result.backend = backend.describe()
    for job in jobs.values():
        try:
            check_backend_supports(backend, settings, job)
        except ConfigurationError as exc:
            result.problem(f"beat_schedule[{job.name!r}]", str(exc))
    if backend.kind == "sqlite":
        result.warnings.append(
            f"claims are kept in a local SQLite file ({backend.describe()}): instances on "
            "other hosts do not see them. To run beat on several hosts, set anarchon_backend "
            "to a shared Redis, PostgreSQL, MySQL or RabbitMQ URL."
        )
    return backend


def _check_backend_url(app: Any, result: CheckResult) -> None:
    """Check the backend URL and options alone (when other settings are
    broken): the scheme is known, its driver installed, its options valid."""
    url = app.conf.get("anarchon_backend")
    options = app.conf.get("anarchon_backend_options") or {}
    if not isinstance(url, str) or not url or not isinstance(options, Mapping):
        return
    try:
        result.backend = backend_from_url(
            url, instance="anarchon-check", options=dict(options)
        ).describe()
    except ConfigurationError as exc:
        result.problem("anarchon_backend", str(exc))


def _check_connect(backend: Backend, settings: Settings, result: CheckResult) -> None:
    try:
        probe = probe_backend(backend)
    except BackendUnavailable as exc:
        result.unreachable = True
        result.problem("anarchon_backend", f"unreachable: {one_line(exc)}")
        return
    except ConfigurationError as exc:
        result.problem("anarchon_backend", str(exc))
        return
    finally:
        backend.close()
    result.connected = True
    offset = probe.host_offset_ms
    if offset is not None and abs(offset) > settings.max_skew * 1000:
        result.warnings.append(
            f"this host's clock is {offset / 1000:+.1f}s off the backend's, more than "
            f"anarchon_max_skew={settings.max_skew:g}s: sync it (NTP) before running beat here."
        )
