"""The delayed-task store: what every backend's store does, and nothing else.

A store keeps parked tasks (:class:`~celery_anarchon.delayed.model.Parked`)
by due time and lets any number of releasers take the due ones under a
lease, exactly as docs/delayed-tasks.md describes. Every method is one
atomic step in the backend; "due" is judged by the backend's clock (Redis
``TIME``, PostgreSQL ``clock_timestamp()``, MySQL ``UTC_TIMESTAMP(6)``;
SQLite, which serves one host, that host's), never the caller's.

Raises, for every method: :class:`~celery_anarchon.exceptions.BackendUnavailable`
when the backend cannot be reached or does not answer in time.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Sequence

from .model import Parked, ParkedTask, Taken

__all__ = ["DelayedStore", "Listener"]


class Listener(abc.ABC):
    """The backend's push, on a connection of its own: Redis pub/sub, or
    PostgreSQL ``LISTEN``; MySQL and SQLite have none, and their listener
    hears only the parks of its own process."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> bool:
        """Block until a park or reschedule was announced, or ``timeout_s``
        seconds passed; True when one was. Raises BackendUnavailable when
        the connection is lost (the caller polls and opens a new one)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection. Safe to call twice."""


class DelayedStore(abc.ABC):
    """Parked tasks in one backend namespace."""

    #: the store's kind for messages and metrics: ``redis``, ``postgresql``,
    #: ``mysql``, ``sqlite``
    kind: str = ""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the store lives, credentials masked."""

    def new_id(self, key: str | None) -> str:
        """A new task id for a task parked under ``key`` (or none)."""
        return str(uuid.uuid4())

    @abc.abstractmethod
    def now_ms(self) -> int:
        """The backend's clock, epoch ms."""

    @abc.abstractmethod
    def park(self, tasks: Sequence[Parked]) -> list[str]:
        """Park ``tasks``, each atomically; the id of each, in order.

        A task whose ``key`` names a task still parked (pending or in
        flight) is not written: its answer is that task's id. Parking
        announces itself on the backend's push channel when the task is
        due before what was the store's earliest."""

    @abc.abstractmethod
    def cancel(self, key_or_id: str) -> bool:
        """Delete a pending task; True when it was pending (and now is
        gone), False when unknown or in flight (being released)."""

    @abc.abstractmethod
    def reschedule(self, key_or_id: str, due_ms: int) -> bool:
        """Move a pending task to ``due_ms``; True when it was pending."""

    @abc.abstractmethod
    def get(self, key_or_id: str) -> ParkedTask | None:
        """The task with that id, or the one parked under that key."""

    @abc.abstractmethod
    def pending(self, limit: int, before_ms: int | None = None) -> list[ParkedTask]:
        """Up to ``limit`` parked tasks (pending and in flight), earliest
        first, due before ``before_ms`` when given."""

    @abc.abstractmethod
    def count(self) -> int:
        """How many tasks are parked (pending and in flight)."""

    @abc.abstractmethod
    def next_due_ms(self) -> int | None:
        """The earliest time something can be taken (a pending task's due
        time, or an in-flight lease's expiry), epoch ms, or None."""

    def due_in_ms(self) -> int | None:
        """Milliseconds until something can be taken, by the store's clock
        (0 or less: now), or None when nothing is parked."""
        next_ms = self.next_due_ms()
        return None if next_ms is None else next_ms - self.now_ms()

    @abc.abstractmethod
    def take_due(self, limit: int, lease_ms: int, owner: str) -> list[Taken]:
        """Take up to ``limit`` tasks due by the backend's clock (pending
        and due, or in flight under an expired lease: a take-over), each
        under a new lease of ``lease_ms`` with a new fencing token, in one
        atomic step per shard. Earliest first."""

    @abc.abstractmethod
    def finish(self, taken: Sequence[Taken]) -> list[bool]:
        """Delete published tasks; per task True when its lease was still
        current (False: another releaser took it over)."""

    @abc.abstractmethod
    def give_back(
        self, taken: Sequence[Taken], retry_at_ms: int, error: str, *, failed: bool = True
    ) -> list[bool]:
        """Make taken tasks pending again at ``retry_at_ms`` (epoch ms); when
        ``failed`` (their publish failed) their attempts counted and
        ``error`` kept, else (never tried) both left as they were; fenced
        as :meth:`finish`."""

    @abc.abstractmethod
    def mark_started(self, task_id: str, keep_ms: int, owner: str = "") -> bool:
        """The worker's start gate: True for the first delivery of a
        released task id, False for any later one; remembered ``keep_ms``.
        ``owner`` names the delivery asking (one value across its retries):
        when an earlier call of the same owner made the mark and its answer
        was lost, the call answers True again."""

    @abc.abstractmethod
    def listener(self) -> Listener:
        """A new :class:`Listener` on a connection of its own."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the store's backend (a user's own client stays open, as
        the backend's ``close`` does). Safe to call twice."""
