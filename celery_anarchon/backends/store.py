"""The stored-jobs store of a lease backend: definitions and pause states
kept under one change counter (docs/runtime-schedules.md).

Every write takes the next value of one counter, the *version*, in the same
atomic step (a Lua script; a transaction holding the counter's row lock), so
versions are unique and commit in order: a reader that has seen version
``v`` learns every later change by asking for ``version > v``. A removal
keeps a row without a body (a tombstone) so that readers learn of it too; a
later add of the name reuses the row.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "JOB",
    "PAUSE",
    "PRIOR_WRITES",
    "StoredRecord",
    "StoredJobsStore",
    "parse_prior",
    "prior_text",
]

#: Kinds of stored records: a stored job's definition; a job's pause state
#: (code or stored job).
JOB, PAUSE = "job", "pause"


@dataclass(frozen=True)
class StoredRecord:
    """One stored record as written or read.

    Attributes:
        kind: :data:`JOB` or :data:`PAUSE`.
        name: the job's name.
        body: its JSON text, or None once removed.
        version: the change counter's value of its last write.
        committed_ms: when that write committed, epoch ms (the backend's clock).
        prior: ``(version, committed_ms)`` of the writes of this record
            before the last, newest first, at most :data:`PRIOR_WRITES`: a
            reader that missed some (two changes between two of its reads)
            learns when the first of them committed.
    """

    kind: str
    name: str
    body: str | None
    version: int
    committed_ms: int
    prior: tuple[tuple[int, int], ...] = ()

    def first_change_after(self, version: int) -> int:
        """When the first write after ``version`` committed, epoch ms (the
        oldest prior write kept, when more were missed)."""
        missed = [c for v, c in self.prior if v > version]
        return min(missed) if missed else self.committed_ms


@dataclass(frozen=True)
class StoredWrite:
    """One write of :meth:`StoredJobsStore.write_stored_many`.

    Attributes:
        kind: :data:`JOB` or :data:`PAUSE`.
        name: the job's name.
        body: the JSON text, or None to remove the record.
        exists: True: only if the record is there (with a body); False: only
            if it is not; None: either way.
    """

    kind: str
    name: str
    body: str | None
    exists: bool | None = None


#: Most earlier writes a record remembers (:attr:`StoredRecord.prior`).
PRIOR_WRITES = 8


def prior_text(prior: tuple[tuple[int, int], ...]) -> str:
    """``prior`` as stored: ``"12,1796...;9,1796..."``."""
    return ";".join(f"{v},{c}" for v, c in prior)


def parse_prior(text: str | None) -> tuple[tuple[int, int], ...]:
    """:func:`prior_text` read back (unreadable parts left out)."""
    found = []
    for part in (text or "").split(";"):
        version, _, committed = part.partition(",")
        if version.isdigit() and committed.isdigit():
            found.append((int(version), int(committed)))
    return tuple(found)


class StoredJobsStore(abc.ABC):
    """What a backend that keeps stored jobs offers (SQL and Redis)."""

    supports_stored_jobs: ClassVar[bool] = True

    @abc.abstractmethod
    def stored_version(self) -> int:
        """The change counter, 0 before the first write: one GET (Redis) or
        one primary-key SELECT (SQL), what each tick reads.

        Raises:
            BackendUnavailable: no answer.
        """

    @abc.abstractmethod
    def stored_changes(self, since: int = 0) -> list[StoredRecord]:
        """Every record written after version ``since``, oldest first
        (``since=0``: all of them, tombstones included).

        Raises:
            BackendUnavailable: no answer.
        """

    def write_stored(
        self, kind: str, name: str, body: str | None, *, exists: bool | None = None
    ) -> StoredRecord | None:
        """Write one record (``body=None``: remove it) under the next version,
        atomically.

        Args:
            kind: :data:`JOB` or :data:`PAUSE`.
            name: the job's name.
            body: the JSON text, or None to remove.
            exists: True: write only if the record is there (with a body);
                False: only if it is not; None: either way.
        Returns:
            the record written, or None when ``exists`` did not hold
            (nothing was written).
        Raises:
            BackendUnavailable: no answer; nothing or everything was written
                (a retry with the same ``exists`` tells which).
        """
        written = self.write_stored_many([StoredWrite(kind, name, body, exists)])
        if written is None:
            return None
        if written[0] is None:  # removing what is not there: already so
            return None if exists else StoredRecord(kind, name, None, 0, 0)
        return written[0]

    @abc.abstractmethod
    def write_stored_many(self, writes: Sequence[StoredWrite]) -> list[StoredRecord | None] | None:
        """Write several records, all or none, in one atomic step, each
        under its own next version, in order.

        Returns:
            one record per write (None for the removal of a record that is
            not there), or None when the ``exists`` of some write did not
            hold: nothing was written.
        Raises:
            BackendUnavailable: no answer; nothing or everything was written.
        """

    @abc.abstractmethod
    def stored_records(self, names: Sequence[str], kind: str) -> dict[str, StoredRecord]:
        """The current records of ``names`` of one ``kind`` (tombstones left
        out), by name: one lookup per name, not a read of every record.

        Raises:
            BackendUnavailable: no answer.
        """
