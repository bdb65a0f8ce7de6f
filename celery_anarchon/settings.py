"""Settings, read once from Celery's configuration into frozen objects.

Every setting is an ``anarchon_*`` key of ``app.conf`` (Django projects using
``namespace='CELERY'`` write ``CELERY_ANARCHON_*``; Celery maps the prefix).
Durations are seconds (``int``/``float``) or :class:`datetime.timedelta` and
are stored as float seconds. Per-job overrides live under an ``'anarchon'``
key of a ``beat_schedule`` entry.

Bad values raise :class:`~celery_anarchon.exceptions.ConfigurationError` at
start-up, naming the job (when per-job), the setting and the fix.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .exceptions import ConfigurationError
from .times import seconds

__all__ = ["JobOptions", "Settings", "OVERLAP_POLICIES", "CATCH_UP_POLICIES"]

OVERLAP_POLICIES = ("allow", "skip")
CATCH_UP_POLICIES = ("none", "latest", "all")

#: Keys allowed under a beat_schedule entry's ``'anarchon'`` key.
JOB_KEYS = frozenset(
    {
        "jitter",
        "max_late",
        "history_size",
        "history_ttl",
        "overlap",
        "catch_up",
        "catch_up_window",
        "catch_up_limit",
        "anchor",
        "lease_ttl",
        "expires",
        "start_at",
        "end_at",
        "max_runs",
    }
)

#: Default lease, seconds: long enough that a healthy instance always records
#: its send well inside it (a send takes milliseconds; a stalled broker gets
#: ``broker_connection_timeout`` = 4 s by default), short enough that a backup
#: runner takes a dead owner's slot over well within the default ``max_late``
#: of 60 s.
DEFAULT_LEASE_TTL = 30.0

#: Default ``anarchon_run_now_guard``, seconds: a double click, or two quick
#: ``run-now`` calls from scripts, fall well inside it; a deliberate second
#: run a few seconds later does not.
DEFAULT_RUN_NOW_GUARD = 5.0


def _where(job: str | None) -> str:
    return f"beat_schedule[{job!r}]['anarchon']: " if job else ""


def flag(value: Any, *, setting: str) -> bool:
    """A boolean setting: True/False, or the strings and numbers Celery users
    write in environment-driven settings ("true"/"false", "1"/"0", "yes"/"no").

    Raises:
        ConfigurationError: anything else (``bool("false")`` is True).
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigurationError(f"{setting} must be True or False, got {value!r}.")


def _positive_int(value: Any, *, setting: str, job: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{_where(job)}{setting} must be a whole number >= 1, got {value!r}."
        )
    return value


def _choice(value: Any, choices: tuple[str, ...], *, setting: str, job: str | None) -> str:
    if value not in choices:
        raise ConfigurationError(
            f"{_where(job)}{setting} must be one of {', '.join(map(repr, choices))}, got {value!r}."
        )
    return str(value)


@dataclass(frozen=True)
class JobOptions:
    """Effective options of one job (global settings with its overrides).

    Attributes:
        jitter: maximum random claim delay, seconds.
        max_late: a slot later than this is missed, seconds.
        history_size: most history records kept for the job.
        history_ttl: history kept at most this long, seconds (lease backends).
        overlap: ``'allow'`` or ``'skip'``.
        catch_up: ``'none'``, ``'latest'`` or ``'all'``.
        catch_up_window: only missed slots this recent count, seconds.
        catch_up_limit: most slots one catch-up sends.
        lease_ttl: lease length, seconds.
        anchor_ms: anchor of interval schedules, epoch milliseconds (UTC).
        expires: message expiry of each run: None (never), seconds after
            the slot's time, or ``'next_slot'`` (the job's next slot); see
            :func:`celery_anarchon.worker.expires_for`.
        start_at_ms: no slot before this, epoch ms (UTC), or None.
        end_at_ms: no slot after this, epoch ms (UTC), or None: past it the
            job is finished.
        max_runs: most runs the cluster sends of the job (won claims), or
            None; reaching it finishes the job (lease backends).
    """

    jitter: float
    max_late: float
    history_size: int
    history_ttl: float
    overlap: str
    catch_up: str
    catch_up_window: float
    catch_up_limit: int
    lease_ttl: float
    anchor_ms: int = 0
    expires: float | str | None = None
    start_at_ms: int | None = None
    end_at_ms: int | None = None
    max_runs: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (for ``celery anarchon jobs``)."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Settings:
    """All ``anarchon_*`` settings of one app, validated.

    Attributes:
        backend: claim backend URL, or None when ``backend_client`` is used.
        backend_client: a client object the user owns, or None.
        backend_options: backend options (``prefix``, ``slot_ttl``, ...).
        defaults: the global :class:`JobOptions` every job starts from.
        max_skew: clock difference tolerated between instances and the
            backend, seconds.
        allow_eviction: accept a Redis that may evict claim keys.
        explicit: names of the settings the user set explicitly.
        worker_strict: worker integration: when the start gate cannot be
            checked (backend unavailable), discard the delivery (True) or
            run it and log (False, the default); see
            :mod:`celery_anarchon.worker`.
        run_now_guard: a ``run_now`` without a key is refused while the
            job's previous one is younger than this, seconds (0: never).
    """

    backend: str | None
    backend_client: Any
    backend_options: Mapping[str, Any]
    defaults: JobOptions
    max_skew: float
    allow_eviction: bool
    explicit: frozenset[str] = field(default_factory=frozenset)
    worker_strict: bool = False
    run_now_guard: float = DEFAULT_RUN_NOW_GUARD

    @classmethod
    def from_app(cls, app: Any, *, schedule_filename: str | None = None) -> Settings:
        """Read and validate the settings of Celery ``app``.

        Args:
            app: the Celery app.
            schedule_filename: beat's schedule file (``-s``); the default
                SQLite backend lives beside it.
        Raises:
            ConfigurationError: a value is of the wrong type or out of range.
        """
        conf = app.conf
        _refuse_unknown_settings(conf)
        explicit = frozenset(k for k in _GLOBAL_KEYS if conf.get(f"anarchon_{k}") is not None)

        def get(key: str, default: Any) -> Any:
            value = conf.get(f"anarchon_{key}")
            return default if value is None else value

        defaults = JobOptions(
            jitter=seconds(get("jitter", 2.0), setting="anarchon_jitter"),
            max_late=seconds(get("max_late", 60.0), setting="anarchon_max_late"),
            history_size=_positive_int(get("history_size", 100), setting="anarchon_history_size"),
            history_ttl=seconds(
                get("history_ttl", timedelta(days=7)), setting="anarchon_history_ttl"
            ),
            overlap=_choice(
                get("overlap", "allow"), OVERLAP_POLICIES, setting="anarchon_overlap", job=None
            ),
            catch_up=_choice(
                get("catch_up", "none"), CATCH_UP_POLICIES, setting="anarchon_catch_up", job=None
            ),
            catch_up_window=seconds(
                get("catch_up_window", timedelta(days=1)), setting="anarchon_catch_up_window"
            ),
            catch_up_limit=_positive_int(
                get("catch_up_limit", 100), setting="anarchon_catch_up_limit"
            ),
            lease_ttl=seconds(get("lease_ttl", DEFAULT_LEASE_TTL), setting="anarchon_lease_ttl"),
            expires=parse_expires(get("expires", None), setting="anarchon_expires", job=None),
        )
        if defaults.lease_ttl == 0:
            raise ConfigurationError("anarchon_lease_ttl must be above 0 seconds.")
        _check_jitter(defaults, None)
        raw_backend = conf.get("anarchon_backend")
        client = None
        url: str | None
        if raw_backend is None or isinstance(raw_backend, str):
            url = raw_backend or default_backend_url(conf, schedule_filename)
        else:
            url, client = None, raw_backend
        options = conf.get("anarchon_backend_options") or {}
        if not isinstance(options, Mapping):
            raise ConfigurationError(
                f"anarchon_backend_options must be a dict, got {type(options).__name__}."
            )
        return cls(
            backend=url,
            backend_client=client,
            backend_options=dict(options),
            defaults=defaults,
            max_skew=seconds(get("max_skew", 10.0), setting="anarchon_max_skew"),
            allow_eviction=flag(get("allow_eviction", False), setting="anarchon_allow_eviction"),
            explicit=explicit,
            worker_strict=flag(get("worker_strict", False), setting="anarchon_worker_strict"),
            run_now_guard=seconds(
                get("run_now_guard", DEFAULT_RUN_NOW_GUARD), setting="anarchon_run_now_guard"
            ),
        )

    def effective_backend_options(self) -> dict[str, Any]:
        """The options a backend is built with: ``anarchon_backend_options``,
        plus ``allow_eviction`` for Redis when ``anarchon_allow_eviction``."""
        options = dict(self.backend_options)
        scheme = (self.backend or "").split("://", 1)[0].lower()
        if self.allow_eviction and scheme in {"redis", "rediss", "redis+sentinel", "sentinel"}:
            options.setdefault("allow_eviction", True)
        return options

    def job_options(self, job: str, overrides: Mapping[str, Any] | None) -> JobOptions:
        """The effective options of ``job``: defaults with its overrides.

        Raises:
            ConfigurationError: an unknown key or a bad value, naming the job.
        """
        if not overrides:
            return self.defaults
        if not isinstance(overrides, Mapping):
            raise ConfigurationError(
                f"beat_schedule[{job!r}]['anarchon'] must be a dict, got {overrides!r}."
            )
        unknown = sorted(set(overrides) - JOB_KEYS)
        if unknown:
            raise ConfigurationError(
                f"beat_schedule[{job!r}]['anarchon']: unknown key(s) {', '.join(unknown)}."
                f"{_did_you_mean(unknown[0], JOB_KEYS)} Allowed: {', '.join(sorted(JOB_KEYS))}."
            )
        d = self.defaults
        o = overrides

        def dur(key: str, default: float) -> float:
            return seconds(o[key], setting=key, job=job) if key in o else default

        lease_ttl = dur("lease_ttl", d.lease_ttl)
        if lease_ttl == 0:
            raise ConfigurationError(f"{_where(job)}lease_ttl must be above 0 seconds.")
        options = JobOptions(
            jitter=dur("jitter", d.jitter),
            max_late=dur("max_late", d.max_late),
            history_size=(
                _positive_int(o["history_size"], setting="history_size", job=job)
                if "history_size" in o
                else d.history_size
            ),
            history_ttl=dur("history_ttl", d.history_ttl),
            overlap=_choice(
                o.get("overlap", d.overlap), OVERLAP_POLICIES, setting="overlap", job=job
            ),
            catch_up=_choice(
                o.get("catch_up", d.catch_up), CATCH_UP_POLICIES, setting="catch_up", job=job
            ),
            catch_up_window=dur("catch_up_window", d.catch_up_window),
            catch_up_limit=(
                _positive_int(o["catch_up_limit"], setting="catch_up_limit", job=job)
                if "catch_up_limit" in o
                else d.catch_up_limit
            ),
            lease_ttl=lease_ttl,
            anchor_ms=_anchor_ms(o["anchor"], job) if "anchor" in o else d.anchor_ms,
            expires=parse_expires(o.get("expires", d.expires), setting="expires", job=job),
            start_at_ms=_instant_ms(o["start_at"], "start_at", job) if "start_at" in o else None,
            end_at_ms=_instant_ms(o["end_at"], "end_at", job) if "end_at" in o else None,
            max_runs=(
                _positive_int(o["max_runs"], setting="max_runs", job=job)
                if o.get("max_runs") is not None
                else None
            ),
        )
        _check_jitter(options, job)
        _check_bounds(options, job)
        return options


_GLOBAL_KEYS = (
    "jitter",
    "max_late",
    "max_skew",
    "history_size",
    "history_ttl",
    "lease_ttl",
    "overlap",
    "catch_up",
    "catch_up_window",
    "catch_up_limit",
)


#: Every ``anarchon_*`` setting this package reads (any module).
#: The delayed tasks' settings (read by :mod:`celery_anarchon.delayed.settings`).
DELAYED_SETTINGS = frozenset(
    {
        "anarchon_delayed_backend",
        "anarchon_delayed_release",
        "anarchon_delayed_lease",
        "anarchon_delayed_batch",
        "anarchon_delayed_poll",
        "anarchon_delayed_max_bytes",
        "anarchon_delayed_retries",
        "anarchon_delayed_stuck_retry",
        "anarchon_delayed_dedupe_ttl",
        "anarchon_park_countdown_over",
    }
)

KNOWN_SETTINGS = frozenset(
    {f"anarchon_{key}" for key in _GLOBAL_KEYS}
    | {
        "anarchon_backend",
        "anarchon_backend_options",
        "anarchon_allow_eviction",
        "anarchon_expires",
        "anarchon_registry_ttl",
        "anarchon_metrics_port",
        "anarchon_metrics_addr",
        "anarchon_worker_strict",
        "anarchon_run_now_guard",
        "anarchon_web_token",
    }
    | DELAYED_SETTINGS
)


def _did_you_mean(name: str, choices: Any) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def is_anarchon_key(key: Any) -> bool:
    """True for an ``anarchon_*`` key of ``app.conf``, also in the Django
    form (``CELERY_ANARCHON_*`` with ``namespace='CELERY'``)."""
    name = str(key).lower()
    return name.startswith(("anarchon_", "celery_anarchon_"))


def _refuse_unknown_settings(conf: Any) -> None:
    """A misspelled ``anarchon_*`` setting would be silently ignored.

    The suggestion keeps the form the user wrote: ``CELERY_ANARCHON_JITER``
    suggests ``CELERY_ANARCHON_JITTER``, ``anarchon_jiter`` ``anarchon_jitter``.
    """
    for key in conf:
        if not is_anarchon_key(key):
            continue
        written = str(key)
        prefix = len("celery_") if written.lower().startswith("celery_") else 0
        setting = written[prefix:].lower()
        if setting in KNOWN_SETTINGS:
            continue
        close = difflib.get_close_matches(setting, list(KNOWN_SETTINGS), n=1)
        hint = ""
        if close:
            meant = close[0].upper() if written[prefix:].isupper() else close[0]
            hint = f" Did you mean {written[:prefix] + meant!r}?"
        raise ConfigurationError(
            f"{key}: unknown setting.{hint} "
            "See the configuration reference for every anarchon_* setting."
        )


def _check_jitter(options: JobOptions, job: str | None) -> None:
    """A claim is delayed up to ``jitter`` after the slot and a slot later
    than ``max_late`` is missed, so jitter must stay below max_late."""
    if options.jitter >= options.max_late:
        jitter, max_late = (
            ("jitter", "max_late") if job else ("anarchon_jitter", "anarchon_max_late")
        )
        raise ConfigurationError(
            f"{_where(job)}{jitter} ({options.jitter}s) must be below {max_late} "
            f"({options.max_late}s): a claim delayed by the jitter would be recorded as "
            "missed. Lower the jitter or raise max_late."
        )


#: The ``expires`` value that makes a run's message expire at the job's next slot.
EXPIRES_NEXT_SLOT = "next_slot"


def parse_expires(value: Any, *, setting: str, job: str | None) -> float | str | None:
    """An ``expires`` setting: None, ``'next_slot'``, or seconds above 0.

    Raises:
        ConfigurationError: anything else.
    """
    if value is None or value == EXPIRES_NEXT_SLOT:
        return value
    if isinstance(value, (int, float, timedelta)) and not isinstance(value, bool):
        result = seconds(value, setting=setting, job=job)
        if result > 0:
            return result
    raise ConfigurationError(
        f"{_where(job)}{setting} must be None (no expiry), a number of seconds above 0 "
        f"(or a timedelta) counted from the slot's time, or {EXPIRES_NEXT_SLOT!r}; "
        f"got {value!r}."
    )


def _anchor_ms(value: Any, job: str) -> int:
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigurationError(
                f"{_where(job)}anchor must be a timezone-aware datetime, got naive {value!r}; "
                "add tzinfo=timezone.utc (or the zone you mean)."
            )
        return int(round(value.timestamp() * 1000))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(round(value * 1000))
    raise ConfigurationError(
        f"{_where(job)}anchor must be an aware datetime or epoch seconds, got {value!r}."
    )


def _instant_ms(value: Any, setting: str, job: str) -> int:
    """An instant from an aware datetime or an ISO 8601 text with a zone, epoch ms.

    Raises:
        ConfigurationError: a naive datetime or text, or anything else.
    """
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise ConfigurationError(
                f"{_where(job)}{setting}: {value!r} is not an ISO 8601 instant; give e.g. "
                "'2027-01-01T00:00:00Z'."
            ) from None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ConfigurationError(
                f"{_where(job)}{setting} must carry a time zone, got naive {value.isoformat()}; "
                "add tzinfo=timezone.utc (or the zone you mean), or 'Z' to the text."
            )
        return int(round(value.timestamp() * 1000))
    raise ConfigurationError(
        f"{_where(job)}{setting} must be an aware datetime or an ISO 8601 text, got {value!r}."
    )


def _check_bounds(options: JobOptions, job: str) -> None:
    start, end = options.start_at_ms, options.end_at_ms
    if start is not None and end is not None and end < start:
        raise ConfigurationError(
            f"{_where(job)}end_at is before start_at: the job would never run. Fix: give an "
            "end_at at or after start_at, or leave one out."
        )


def first_broker_url(conf: Any) -> str:
    """The first URL of ``broker_url`` (which may be a list or ``;``-joined)."""
    broker = conf.get("broker_url") or conf.get("broker_write_url") or ""
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else ""
    return str(broker).split(";")[0].strip()


def default_backend_url(conf: Any, schedule_filename: str | None) -> str:
    """The backend used when ``anarchon_backend`` is unset.

    The broker itself when it is Redis or RabbitMQ (zero configuration), else
    a SQLite file beside beat's schedule file (``<schedule>.anarchon.db``).
    """
    broker = first_broker_url(conf)
    scheme = broker.split("://", 1)[0].lower() if "://" in broker else ""
    if scheme in {"redis", "rediss", "sentinel", "redis+sentinel"}:
        return broker
    if scheme in {"amqp", "amqps", "pyamqp"}:
        return broker
    filename = schedule_filename or conf.get("beat_schedule_filename") or "celerybeat-schedule"
    return f"sqlite:///{os.path.abspath(filename)}.anarchon.db"


def started_by_beat() -> bool:
    """True when ``celery beat`` (its ``Service.start``) is starting the
    scheduler on this call stack, False when a program builds it directly.

    Beat logs an error escaping the scheduler's set-up with its traceback,
    then the process prints it again on standard error, which beat redirects
    to the log one line per fragment. A configuration error, already logged
    on one CRITICAL line per problem, therefore ends beat with
    :class:`SystemExit` instead; a program building the scheduler itself
    still gets the :class:`~celery_anarchon.exceptions.ConfigurationError`.
    """
    import sys
    from types import FrameType

    from celery.beat import Service

    start = Service.start.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is start:
            return True
        frame = frame.f_back
    return False
