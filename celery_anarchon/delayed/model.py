"""What a parked task is, and the one payload format every store keeps.

A parked task is always in exactly one state (docs/delayed-tasks.md):

* ``pending``: in the store, due at ``due_ms``;
* ``in flight``: taken by a releaser under a lease (an expiry and a fencing
  token); a releaser that dies loses the lease when it expires and another
  takes the task over, fenced;
* released: published to Celery's broker and deleted from the store.

The payload is JSON text. The task's ``args`` and ``kwargs`` are encoded by
the task's serializer (Celery's ``task_serializer``, or the ``serializer``
option) when the task is parked, so arguments the serializer refuses raise
at :func:`~celery_anarchon.delayed.park`, never at release.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kombu.serialization import dumps, loads

__all__ = [
    "IN_FLIGHT",
    "PENDING",
    "Parked",
    "ParkedTask",
    "Taken",
    "decode_payload",
    "encode_payload",
]

PENDING = "pending"
IN_FLIGHT = "in flight"


@dataclass(frozen=True)
class Parked:
    """One task to park: what a store writes.

    Attributes:
        id: the Celery task id the message will carry.
        key: the idempotency key, or None.
        task: the task's name.
        due_ms: when it is due, epoch milliseconds (UTC).
        payload: :func:`encode_payload`'s JSON text.
    """

    id: str
    key: str | None
    task: str
    due_ms: int
    payload: str


@dataclass(frozen=True)
class ParkedTask:
    """A parked task as a store reads it back.

    Attributes:
        id: the Celery task id.
        key: the idempotency key, or None.
        task: the task's name.
        due_ms: pending: when it is due; in flight: when its lease expires,
            epoch ms (UTC).
        state: :data:`PENDING` or :data:`IN_FLIGHT`.
        payload: the JSON text :func:`encode_payload` made.
        attempts: publishes that failed so far.
        error: why the last publish failed, or None.
        token: the fencing token of the lease it is in flight under (0 while
            pending).
    """

    id: str
    key: str | None
    task: str
    due_ms: int
    state: str
    payload: str
    attempts: int = 0
    error: str | None = None
    token: int = 0

    def decoded(self) -> dict[str, Any]:
        """:func:`decode_payload` of :attr:`payload`."""
        return decode_payload(self.payload)

    def summary(self) -> dict[str, Any]:
        """A JSON-safe dict for the commands' ``--json`` and the web page:
        id, key, task, due_ms, state, attempts, error, parked_ms, args,
        kwargs (decoded) and options."""
        body = self.decoded()
        return {
            "id": self.id,
            "key": self.key,
            "task": self.task,
            "due_ms": self.due_ms if self.state == PENDING else body.get("due_ms", self.due_ms),
            "state": self.state,
            "attempts": self.attempts,
            "error": self.error,
            "parked_ms": body.get("parked_ms"),
            "args": _jsonable(body.get("args")),
            "kwargs": _jsonable(body.get("kwargs")),
            "options": body.get("options", {}),
        }


@dataclass(frozen=True)
class Taken:
    """A task a releaser took: in flight under ``token`` until ``lease_ms``.

    Attributes:
        task: the task as read when taken.
        token: the lease's fencing token; :meth:`DelayedStore.finish` and
            :meth:`DelayedStore.give_back` act only while it is current.
        taken_over: True when the task was in flight under another lease
            that had expired (its releaser died or froze): the earlier
            releaser may have published it already.
        now_ms: the store's clock when it was taken, epoch ms.
    """

    task: ParkedTask
    token: int
    taken_over: bool = False
    now_ms: int = 0


def encode_payload(
    *,
    task: str,
    args: Any,
    kwargs: Any,
    options: Mapping[str, Any],
    serializer: str,
    key: str | None,
    parked_ms: int,
    due_ms: int,
) -> str:
    """The payload of one parked task, as JSON text, with a random
    ``parking`` id of its own (the worker's start gate marks each parking
    apart).

    ``args`` and ``kwargs`` are encoded together by ``serializer`` (a
    kombu serializer name: ``json``, ``pickle``, ``msgpack``, ``yaml``);
    a JSON body is kept as JSON within the payload (field ``json``), others
    as text (``body``), base64 when binary.

    Raises:
        kombu.exceptions.EncodeError: the serializer refuses the arguments.
        TypeError: ``options`` is not JSON-safe.
    """
    content_type, encoding, body = dumps([list(args), dict(kwargs)], serializer=serializer)
    fields: dict[str, Any] = {"task": task}
    if content_type == "application/json":
        # Kept as JSON, not as a string of JSON: no second escaping.
        fields["json"] = json.loads(body)
    elif isinstance(body, bytes):
        try:
            fields["body"], fields["binary"] = body.decode("utf-8"), False
        except UnicodeDecodeError:
            fields["body"], fields["binary"] = base64.b64encode(body).decode("ascii"), True
    else:
        fields["body"], fields["binary"] = body, False
    fields.update(
        content_type=content_type,
        encoding=encoding,
        serializer=serializer,
        options=dict(options),
        key=key,
        parked_ms=parked_ms,
        due_ms=due_ms,
        parking=uuid.uuid4().hex,
    )
    return json.dumps(fields, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def decode_payload(payload: str) -> dict[str, Any]:
    """The payload's fields, with ``args`` (a list) and ``kwargs`` (a
    dict) decoded by the serializer they were encoded with.

    Raises:
        ValueError: the payload is not one :func:`encode_payload` made.
    """
    body = json.loads(payload)
    data: bytes | str
    if "json" in body:
        data = json.dumps(body.pop("json"))
    else:
        raw = body.pop("body")
        data = base64.b64decode(raw) if body.pop("binary", False) else raw
    args, kwargs = loads(
        data,
        body["content_type"],
        body["encoding"],
        accept={body["content_type"]},
    )
    body["args"], body["kwargs"] = list(args), dict(kwargs)
    return body


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value
