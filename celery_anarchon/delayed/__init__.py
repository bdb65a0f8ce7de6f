"""Durable delayed tasks: park a task in the claim backend until it is due,
and let the beat cluster release it exactly once (docs/delayed-tasks.md).

A parked task becomes an ordinary Celery message when it is released, so
workers need nothing new; with the worker integration installed
(:func:`celery_anarchon.worker.install`) a second delivery of one released
task id is discarded.

Every function takes the Celery app first and reuses one store client per
app (and per process: a forked child makes its own).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from celery.canvas import Signature

from ..exceptions import ConfigurationError
from ..message import HEADER_DELAYED
from .model import IN_FLIGHT, PENDING, Parked, ParkedTask, decode_payload, encode_payload
from .settings import DelayedSettings
from .store import DelayedStore

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..settings import Settings

__all__ = [
    "HEADER_DELAYED",
    "IN_FLIGHT",
    "OPTIONS",
    "PENDING",
    "ParkedTask",
    "cancel",
    "count",
    "decode_payload",
    "get",
    "park",
    "park_many",
    "pending",
    "reschedule",
    "delayed_backend",
    "delayed_off",
    "store_for",
    "store_from_backend",
    "store_in",
]


#: The ``apply_async`` options ``park`` keeps for the release. ``expires`` in
#: seconds counts from the due time; ``queue`` may be a kombu ``Queue`` (its
#: name is kept); ``link`` and ``link_error`` are signatures (or lists of
#: them). The second group is what Celery's ``retry()``, chains and groups
#: pass on (the attempt count, the parent and root ids, the rest of a
#: chain, the group or chord it belongs to), kept as Celery sends them.
OPTIONS = frozenset(
    {
        "queue",
        "routing_key",
        "exchange",
        "priority",
        "expires",
        "headers",
        "serializer",
        "compression",
        "time_limit",
        "soft_time_limit",
        "ignore_result",
        "shadow",
        "task_id",
        "link",
        "link_error",
    }
    | {
        "retries",
        "root_id",
        "parent_id",
        "group_id",
        "group_index",
        "chord",
        "chain",
        "reply_to",
        "replaced_task_nesting",
        "origin",
    }
)

_STORES: dict[Any, tuple[int, DelayedStore, DelayedSettings]] = {}
_STORES_LOCK = threading.Lock()


def store_for(app: Any) -> tuple[DelayedStore, DelayedSettings]:
    """The app's delayed store (made once per app and process) and the
    delayed settings.

    The store lives in the backend ``anarchon_delayed_backend`` names, else
    in the claim backend (``anarchon_backend``).

    Raises:
        ConfigurationError: a bad setting (``anarchon_delayed_backend``
            included, named); no backend of the set-up keeps delayed tasks
            (claims on RabbitMQ and no ``anarchon_delayed_backend``: the
            message says why and what to set).
    """
    pid = os.getpid()
    with _STORES_LOCK:
        known = _STORES.get(app)
        if known is not None and known[0] == pid:
            return known[1], known[2]
        store, settings = _make_store(app)
        _STORES[app] = (pid, store, settings)
        return store, settings


def _make_store(app: Any) -> tuple[DelayedStore, DelayedSettings]:
    from ..settings import Settings

    settings = Settings.from_app(app)
    delayed = DelayedSettings.from_app(app)
    backend = delayed_backend(settings, delayed, instance=f"delayed-{os.getpid()}")
    return store_in(backend, delayed), delayed


#: Where the docs say why a queue keeps no parked tasks.
RABBITMQ_DOC = "docs/delayed-designs.md#why-rabbitmq-keeps-no-parked-tasks"

#: The fix named by every refusal of a RabbitMQ store.
_FIX = (
    'set anarchon_delayed_backend = "redis://HOST:6379/0" (or a postgresql://, mysql:// '
    "or, for one host, sqlite:/// URL); the claims stay where anarchon_backend puts them"
)


def delayed_off(settings: Settings, delayed: DelayedSettings) -> str | None:
    """Why this set-up keeps no delayed tasks, or None when it keeps them.

    Only one set-up keeps none: claims on RabbitMQ (``anarchon_backend``, or
    a RabbitMQ broker by default) and no ``anarchon_delayed_backend``. A
    queue cannot hold the store's contract (cancel, reschedule and get by
    key or id, idempotent keys, counts) without a second store
    (docs/delayed-designs.md).

    Args:
        settings: the app's :class:`~celery_anarchon.settings.Settings`.
        delayed: its :class:`DelayedSettings`.
    """
    from ..backends import backend_from_settings

    if delayed.backend is not None:
        return None
    try:
        claims = backend_from_settings(settings, instance="anarchon-delayed")
    except ConfigurationError:  # a bad claim backend is reported as such
        return None
    if claims.kind != "rabbitmq":
        return None
    return (
        f"delayed tasks are off: anarchon_backend is RabbitMQ ({claims.describe()}) and "
        "anarchon_delayed_backend is not set; a queue cannot cancel, reschedule or find a "
        f"parked task by key, nor count them ({RABBITMQ_DOC}). To park, {_FIX}."
    )


def delayed_backend(settings: Settings, delayed: DelayedSettings, *, instance: str) -> Backend:
    """The backend that keeps the parked tasks, built, not connected: the
    one ``anarchon_delayed_backend`` names (its options from its URL's
    query, e.g. ``?prefix=app:``; ``anarchon_backend_options`` belong to
    the claim backend), else the claim backend.

    Args:
        settings: the app's :class:`~celery_anarchon.settings.Settings`.
        delayed: its :class:`DelayedSettings`.
        instance: the owner named in the backend's leases.
    Raises:
        ConfigurationError: ``anarchon_delayed_backend`` is not a URL a
            backend serves, or is RabbitMQ (naming the setting, credentials
            masked); the set-up keeps no delayed tasks (:func:`delayed_off`).
    """
    from ..backends import backend_from_settings

    off = delayed_off(settings, delayed)
    if off is not None:
        raise ConfigurationError(off)
    backend = (
        backend_from_settings(settings, instance=instance)
        if delayed.backend is None
        else _own_delayed_backend(delayed.backend, settings, instance)
    )
    backend.role = "delayed store"
    return backend


def _own_delayed_backend(url: str, settings: Settings, instance: str) -> Backend:
    """The backend of ``anarchon_delayed_backend`` = ``url``, not opened.

    Raises:
        ConfigurationError: a URL no backend serves, or RabbitMQ (naming
            the setting, credentials masked).
    """
    from ..backends import backend_from_url, sanitize_url, scheme_of

    shown = sanitize_url(url)
    options = {}
    if settings.allow_eviction and scheme_of(url) in {"redis", "rediss", "redis+sentinel"}:
        options["allow_eviction"] = True
    try:
        backend = backend_from_url(url, instance=instance, options=options)
    except ConfigurationError as exc:
        raise ConfigurationError(
            f"anarchon_delayed_backend = {shown!r}: {_without_setting(str(exc))}"
        ) from exc
    if backend.kind == "rabbitmq":
        raise ConfigurationError(
            f"anarchon_delayed_backend = {shown!r} is RabbitMQ, which keeps no parked tasks "
            f"({RABBITMQ_DOC}); give a Redis or SQL URL: {_FIX}."
        )
    return backend


def store_in(backend: Backend, delayed: DelayedSettings) -> DelayedStore:
    """The delayed store in ``backend`` (from :func:`delayed_backend`),
    not opened yet.

    Raises:
        ConfigurationError: that backend keeps no delayed tasks; naming
            ``anarchon_delayed_backend`` when the setting chose it.
    """
    try:
        return store_from_backend(backend)
    except ConfigurationError as exc:
        if delayed.backend is None:
            raise
        raise ConfigurationError(
            f"anarchon_delayed_backend: {backend.describe()} keeps no delayed tasks; give "
            "the URL of a backend that does (docs/delayed-tasks.md#where-parked-tasks-live)."
        ) from exc


def _without_setting(message: str) -> str:
    """A backend's error without its leading ``anarchon_backend`` (or
    ``anarchon_backend_options``) name, for a message that names
    ``anarchon_delayed_backend`` instead."""
    for name in ("anarchon_backend_options", "anarchon_backend"):
        if message.startswith(name):
            return message[len(name) :].lstrip(" :")
    return message


def store_from_backend(backend: Any) -> DelayedStore:
    """The delayed store that lives in ``backend`` (not opened yet): Redis,
    PostgreSQL, MySQL/MariaDB or SQLite (one host).

    Raises:
        ConfigurationError: the backend has no delayed store (RabbitMQ).
    """
    from ..backends.redis import RedisBackend
    from ..backends.sql import SQLBackend

    if isinstance(backend, RedisBackend):
        from .redis import RedisDelayedStore

        return RedisDelayedStore(backend)
    if isinstance(backend, SQLBackend):
        if backend.kind == "postgresql":
            from .postgres import PostgresDelayedStore

            return PostgresDelayedStore(backend)
        from .sql import SQLDelayedStore

        return SQLDelayedStore(backend)
    raise ConfigurationError(
        f"anarchon_backend: {backend.describe()} keeps no delayed tasks; parking needs a "
        "Redis, PostgreSQL, MySQL/MariaDB or SQLite backend. Set anarchon_backend to a "
        "redis://, postgresql://, mysql:// or sqlite:/// URL (the claim backend and the "
        "delayed store are the same)."
    )


def _due_ms(eta: Any, countdown: Any, what: str = "park") -> int:
    if eta is not None and countdown is not None:
        raise ValueError(f"{what}: give eta or countdown, not both.")
    now = int(time.time() * 1000)
    if countdown is not None:
        if isinstance(countdown, timedelta):
            countdown = countdown.total_seconds()
        if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
            raise TypeError(f"{what}: countdown must be seconds, got {countdown!r}.")
        if countdown != countdown or countdown in (float("inf"), float("-inf")):
            raise ValueError(f"{what}: countdown must be a finite number, got {countdown!r}.")
        return now + max(0, int(countdown * 1000))
    if eta is None:
        return now
    if not isinstance(eta, datetime):
        raise TypeError(f"{what}: eta must be an aware datetime, got {eta!r}.")
    if eta.tzinfo is None or eta.utcoffset() is None:
        raise ValueError(
            f"{what}: {eta.isoformat()} is naive; give an aware datetime "
            "(datetime.now(timezone.utc) + ..., or eta.replace(tzinfo=ZoneInfo(...)))."
        )
    return int(eta.timestamp() * 1000)


def _option_value(name: str, value: Any) -> Any:
    if name == "queue" and not isinstance(value, str) and hasattr(value, "name"):
        return value.name
    if name == "exchange" and not isinstance(value, str) and hasattr(value, "name"):
        return value.name
    if name in ("link", "link_error"):
        # One signature or many, as Celery takes them; kept as a list.
        return list(value) if isinstance(value, (list, tuple)) else [value]
    if name == "expires":
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError("park: the expires option is a naive datetime; make it aware.")
            return value.isoformat()
        if isinstance(value, timedelta):
            value = value.total_seconds()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"park: expires must be seconds or an aware datetime, got {value!r}.")
        # Seconds are kept as seconds: Celery counts them from the send,
        # which is the release (also after a reschedule).
        return float(value)
    return value


def _parked(
    app: Any,
    store: DelayedStore,
    settings: DelayedSettings,
    task: Any,
    args: Any,
    kwargs: Any,
    *,
    eta: Any,
    countdown: Any,
    key: str | None,
    options: Mapping[str, Any],
) -> Parked:
    if isinstance(task, Signature):
        # The call's args are prepended to the signature's (a partial), its
        # kwargs and options win, and an immutable signature keeps its own
        # arguments: as Signature.apply_async merges them (Signature._merge).
        if task.get("subtask_type"):
            raise TypeError(f"park: a {task['subtask_type']} cannot be parked; park a task.")
        if task.immutable:
            args, kwargs = tuple(task.args), dict(task.kwargs)
        else:
            args = (*(args or ()), *task.args)
            kwargs = {**task.kwargs, **(kwargs or {})}
        options = {**task.options, **options}
        task = task.task
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"park: task must be a task or a task name, got {task!r}.")
    if key is not None and (not isinstance(key, str) or not key or "\x00" in key):
        raise ValueError(f"park: key must be a non-empty string without NUL, got {key!r}.")
    unknown = sorted(set(options) - OPTIONS - {"countdown", "eta"})
    if unknown:
        raise TypeError(
            f"park {name}: option(s) {', '.join(unknown)} cannot be parked; parked tasks keep "
            f"{', '.join(sorted(OPTIONS))}."
        )
    if "countdown" in options or "eta" in options:
        raise TypeError(f"park {name}: give eta= or countdown= as park's own arguments.")
    due_ms = _due_ms(eta, countdown)
    kept = {k: _option_value(k, v) for k, v in options.items() if v is not None}
    task_id = kept.pop("task_id", None)
    if task_id is not None and (not isinstance(task_id, str) or key is not None):
        raise ValueError(
            f"park {name}: task_id must be a string, and cannot be given with key= "
            "(a keyed task's id is chosen by the store)."
        )
    registered = app.tasks.get(name) if isinstance(task, str) else task
    serializer = kept.get("serializer") or getattr(registered, "serializer", None)
    serializer = serializer or app.conf.task_serializer
    args = () if args is None else args
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, Mapping):
        raise TypeError(f"park {name}: args must be a list or tuple and kwargs a mapping.")
    _check_arguments(registered, name, args, kwargs)
    try:
        payload = encode_payload(
            task=name,
            args=args,
            kwargs=kwargs,
            options=kept,
            serializer=serializer,
            key=key,
            parked_ms=int(time.time() * 1000),
            due_ms=due_ms,
        )
    except (TypeError, ValueError) as exc:  # kombu raises EncodeError, which passes through
        raise TypeError(f"park {name}: the options are not JSON-safe ({exc}).") from exc
    size = len(payload.encode("utf-8"))
    if size > settings.max_bytes:
        raise ValueError(
            f"park {name}: the task's payload is {size} bytes, over anarchon_delayed_max_bytes "
            f"({settings.max_bytes}); keep large data elsewhere and park a reference to it."
        )
    return Parked(
        id=task_id or store.new_id(key), key=key, task=name, due_ms=due_ms, payload=payload
    )


def _check_arguments(task: Any, name: str, args: Any, kwargs: Mapping[str, Any]) -> None:
    """Celery's own argument check (``apply_async`` under ``typing``, the
    default) for a task registered in this process, so a call its signature
    refuses is refused at park, not at release."""
    if task is None or not getattr(task, "typing", False):
        return
    header = getattr(task, "__header__", None)
    if header is None:
        return
    try:
        header(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(
            f"park {name}: the task's signature refuses these arguments: {exc}"
        ) from exc


def park(
    app: Any,
    task: Any,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    eta: datetime | None = None,
    countdown: float | timedelta | None = None,
    key: str | None = None,
    **options: Any,
) -> str:
    """Park ``task`` until it is due; return the Celery task id its message
    will carry.

    Args:
        app: the Celery app (its ``anarchon_backend`` is the store).
        task: a task object, a task name (an unknown name is parked by
            name, as ``send_task`` would), or a signature (``add.s(2)``:
            merged as ``Signature.apply_async`` merges: the call's args
            before the signature's, the call's kwargs and options over
            its own; an immutable signature keeps its arguments).
        args, kwargs: the task's arguments, encoded now by the task's
            serializer.
        eta: an aware datetime; one in the past is released at once.
        countdown: seconds (or a timedelta) from now (this host's clock).
            Neither given: due now.
        key: makes parking idempotent: while a task parked under ``key``
            is pending or in flight, parking again changes nothing and
            returns its id.
        options: ``apply_async`` options kept for the release
            (:data:`OPTIONS`): queue, routing_key, exchange, priority,
            expires (seconds count from the release, as Celery counts
            them from the send), headers, ...
    Raises:
        kombu.exceptions.EncodeError: the serializer refuses the arguments.
        ValueError: a naive eta, eta and countdown both given, a payload
            over ``anarchon_delayed_max_bytes``.
        TypeError: the task's signature refuses the arguments (a task
            registered in this process, under Celery's ``typing``); an
            option that cannot be parked, or is not JSON-safe.
        ConfigurationError: the backend keeps no delayed tasks.
        BackendUnavailable: the store cannot be reached, or did not answer
            in time; there is no in-memory fallback. When the store applied
            the park but its answer was lost, the task is parked: park with
            a ``key`` to make trying again safe.
    """
    store, settings = store_for(app)
    parked = _parked(
        app,
        store,
        settings,
        task,
        args,
        kwargs,
        eta=eta,
        countdown=countdown,
        key=key,
        options=options,
    )
    return store.park([parked])[0]


#: The keys of one :func:`park_many` call.
_CALL_KEYS = frozenset({"task", "args", "kwargs", "eta", "countdown", "key", "options"})


def park_many(app: Any, calls: Iterable[Mapping[str, Any]]) -> list[str]:
    """Park many tasks in few round trips (a Redis pipeline, one SQL
    transaction); the ids in order.

    Each call is a mapping of :func:`park`'s arguments: ``task`` and,
    optionally, ``args``, ``kwargs``, ``eta``, ``countdown``, ``key`` and
    ``options`` (a mapping). Each task is parked atomically on its own; all
    are checked before any is written.

    Raises:
        TypeError: a call with a key not among those; and what :func:`park`
            raises, for the first bad call (nothing parked then).
    """
    store, settings = store_for(app)
    calls = list(calls)
    for call in calls:
        unknown = sorted(set(call) - _CALL_KEYS)
        if unknown:
            raise TypeError(
                f"park_many: unknown key(s) {', '.join(map(repr, unknown))} in {dict(call)!r}; "
                f"a call takes {', '.join(sorted(_CALL_KEYS))} (apply_async options go under "
                "'options')."
            )
    batch = [
        _parked(
            app,
            store,
            settings,
            call["task"],
            call.get("args", ()),
            call.get("kwargs"),
            eta=call.get("eta"),
            countdown=call.get("countdown"),
            key=call.get("key"),
            options=call.get("options") or {},
        )
        for call in calls
    ]
    return store.park(batch) if batch else []


def cancel(app: Any, key_or_id: str) -> bool:
    """Cancel a pending task, by its key or its task id.

    Returns:
        True when it was pending and is now gone for good; False when no
        such task is parked, or it is in flight (being released): then it
        will be (or was) sent. Atomic against a concurrent release.
    Raises:
        BackendUnavailable: the store cannot be reached (nothing changed).
    """
    store, _ = store_for(app)
    return store.cancel(key_or_id)


def reschedule(app: Any, key_or_id: str, eta: datetime | float | timedelta) -> bool:
    """Move a pending task to ``eta`` (an aware datetime, or a countdown in
    seconds or a timedelta from now).

    Returns:
        True when it was pending and now is due at ``eta``; False when no
        such task is parked or it is in flight. Atomic against a release.
    Raises:
        ValueError: a naive datetime. BackendUnavailable: as :func:`cancel`.
    """
    store, _ = store_for(app)
    if isinstance(eta, datetime):
        due_ms = _due_ms(eta, None, "reschedule")
    else:
        due_ms = _due_ms(None, eta, "reschedule")
    return store.reschedule(key_or_id, due_ms)


def get(app: Any, key_or_id: str) -> ParkedTask | None:
    """The parked task with that key or id (pending or in flight), or None
    (never parked, cancelled, or released)."""
    store, _ = store_for(app)
    return store.get(key_or_id)


def pending(app: Any, limit: int = 100, before: datetime | None = None) -> list[ParkedTask]:
    """Up to ``limit`` parked tasks, earliest due first; only those due
    before ``before`` (an aware datetime) when given."""
    store, _ = store_for(app)
    before_ms = None if before is None else _due_ms(before, None, "pending")
    return store.pending(limit, before_ms)


def count(app: Any) -> int:
    """How many tasks are parked (pending and in flight)."""
    store, _ = store_for(app)
    return store.count()
