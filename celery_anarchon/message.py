"""The message of one slot: what beat publishes and the worker reads.

Task ids derived from ``(job, slot)``, the ``anarchon_*`` headers, the
message expiry, and :func:`send_slot`, the one publish path. Beat and the
worker integration both import this module, never each other.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from celery import beat

from .settings import EXPIRES_NEXT_SLOT, JobOptions, parse_expires
from .times import utc as _utc

__all__ = [
    "HEADER_DELAYED",
    "HEADER_PARKING",
    "HEADER_JOB",
    "HEADER_SLOT",
    "HEADER_TOKEN",
    "REDIS_TRANSPORTS",
    "TASK_ID_NAMESPACE",
    "bounded_connection",
    "expires_for",
    "manual_task_id",
    "message_expiry_ms",
    "send_slot",
    "task_id_for",
]

#: Namespace of the task ids derived from ``(job, slot)``.
TASK_ID_NAMESPACE = uuid.UUID("6b3f4a52-2d0e-4c1e-9a55-0d1f3c7e8a90")

#: kombu transports that ignore ``connect_timeout`` (their own socket
#: timeouts are set instead, see :func:`bounded_connection`).
REDIS_TRANSPORTS = frozenset({"redis", "rediss", "sentinel"})

#: Message headers the scheduler sets (see docs/how-it-works.md).
HEADER_JOB = "anarchon_job"
HEADER_SLOT = "anarchon_slot"
HEADER_TOKEN = "anarchon_token"
#: The header of a released parked task (its value: the store's namespace);
#: the worker integration's start gate discards a second delivery of its id.
HEADER_DELAYED = "anarchon_delayed"

#: The header naming one parking of a released task (a random id written
#: when it was parked): the worker's start gate marks each parking apart, so
#: a task id parked again after it ran runs again, as Celery runs a reused id,
#: while a second delivery of one parking is discarded.
HEADER_PARKING = "anarchon_parking"


def task_id_for(job: str, slot_ms: int, *, namespace: str) -> str:
    """The Celery task id of ``job``'s run at ``slot_ms`` (epoch ms):
    ``uuid5(TASK_ID_NAMESPACE, "<namespace>\\0<job>\\0<slot_ms>")``.

    ``namespace`` is the claim backend's (:attr:`Backend.namespace`, its
    prefix): the same on every host of one cluster, so a second publish of
    one slot carries the same id; different for two projects that keep
    their claims apart, so their runs of a same-named job at one slot never
    share an id (nor a result in a shared result backend).
    """
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{namespace}\x00{job}\x00{slot_ms}"))


def manual_task_id(job: str, key: str, *, namespace: str) -> str:
    """The task id of a ``run_now`` of ``job`` under ``key``, in the claim
    backend's ``namespace`` (as :func:`task_id_for`)."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{namespace}\x00{job}\x00manual\x00{key}"))


def expires_for(
    expires: JobOptions | float | timedelta | str | None, slot_ms: int, next_slot_ms: int | None
) -> datetime | None:
    """When the message of one run expires (Celery's ``expires`` option).

    Args:
        expires: a job's options (their ``expires``), or an ``anarchon_expires``
            value: None (never), seconds (or a timedelta) counted from the
            slot's time, or ``'next_slot'``.
        slot_ms: the run's slot, epoch milliseconds (UTC).
        next_slot_ms: the job's next slot after ``slot_ms``, epoch
            milliseconds, or None when there is none.
    Returns:
        an aware UTC datetime, or None for no expiry (also for
        ``'next_slot'`` when there is no next slot).
    Raises:
        ConfigurationError: a value that is none of those.
    """
    value = expires.expires if isinstance(expires, JobOptions) else expires
    value = parse_expires(value, setting="anarchon_expires", job=None)
    if value is None:
        return None
    if value == EXPIRES_NEXT_SLOT:
        return None if next_slot_ms is None else _utc(next_slot_ms)
    return _utc(slot_ms) + timedelta(seconds=float(value))


def message_expiry_ms(
    option: Any, anarchon_expiry: datetime | None, sent_at_ms: int | None
) -> int | None:
    """When a run's message expires, epoch milliseconds (UTC), or None
    (never, or not known).

    The same precedence as the scheduler's send: the entry's own Celery
    ``expires`` option wins over ``anarchon_expires``.

    Args:
        option: the entry's ``options['expires']``: None, seconds counted
            from the send (Celery's meaning), or an aware datetime; a naive
            datetime or any other value gives None (its zone is the
            worker's to judge).
        anarchon_expiry: the run's ``anarchon_expires`` as an aware
            datetime (:func:`expires_for`), or None.
        sent_at_ms: when the run was sent, epoch milliseconds, or None.
    """
    if option is None:
        if anarchon_expiry is None:
            return None
        return int(anarchon_expiry.timestamp() * 1000)
    if isinstance(option, bool):
        return None
    if isinstance(option, (int, float)):
        return None if sent_at_ms is None else sent_at_ms + int(option * 1000)
    if isinstance(option, datetime) and option.tzinfo is not None:
        return int(option.timestamp() * 1000)
    return None


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
    declare: Any = None,
) -> Any:
    """Send ``entry``'s task for one slot through Celery's own path.

    ``apply_async`` with the entry's args, kwargs and options (routing,
    queue, expires, ...) untouched, plus the task id and the headers
    ``anarchon_job``, ``anarchon_slot`` (epoch ms), ``anarchon_token`` and
    Celery beat's own ``celery_beat_task``. ``retry`` (when not None)
    replaces the entry's and ``task_publish_retry``: the scheduler passes
    False and retries itself, bounded (:class:`~celery_anarchon.beat.publisher.Publisher`).
    ``declare`` (when not None) is Celery's option of that name: the
    entities to declare before publishing (``[]``: none, for a route the
    connection declared already; the message is the same).

    Returns:
        the ``AsyncResult``.
    Raises:
        Exception: whatever ``apply_async`` raises (broker errors).
    """
    options = dict(entry.options or {})
    headers = dict(options.pop("headers", None) or {})
    headers.update(
        {"celery_beat_task": True, HEADER_JOB: job, HEADER_SLOT: slot_ms, HEADER_TOKEN: token}
    )
    options.pop("task_id", None)
    if expires is not None:  # anarchon_expires; the entry's own option wins
        options.setdefault("expires", expires)
    if retry is not None:
        options["retry"] = retry
    if declare is not None:
        options["declare"] = declare
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


def bounded_connection(app: Any) -> Any:
    """A new broker connection for publishing (``app.connection_for_write()``)
    whose every call is bounded in time.

    The Redis transport ignores ``broker_connection_timeout``: there it is
    also the connection's ``socket_connect_timeout`` and ``socket_timeout``,
    unless ``broker_transport_options`` sets them, so a broker that does not
    answer fails a publish after that long instead of blocking the caller.
    Not connected yet; the caller releases it.
    """
    connection = app.connection_for_write()
    if connection.transport_cls not in REDIS_TRANSPORTS:
        return connection
    timeout = float(app.conf.broker_connection_timeout or 4.0)
    own = app.conf.broker_transport_options or {}
    options = {k: timeout for k in ("socket_connect_timeout", "socket_timeout") if k not in own}
    if not options:
        return connection
    connection.release()
    return app.connection_for_write(transport_options=options)
