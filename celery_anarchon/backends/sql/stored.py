"""Stored jobs in the SQL backend: ``<prefix>stored`` (definitions and pause
states, one row per kind and name) under the change counter kept in
``<prefix>meta`` (docs/runtime-schedules.md).

A write locks the counter's row first (``SELECT .. FOR UPDATE``; SQLite's
``BEGIN IMMEDIATE`` locks the whole file), so writers queue on it, each
takes the next version and commits in that order: a reader asking for
``version > v`` never misses a change committed later under a lower
version. The version is unique in the table (an index), so that question
is one index range scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..store import (
    PRIOR_WRITES,
    StoredJobsStore,
    StoredRecord,
    StoredWrite,
    parse_prior,
    prior_text,
)
from .naming import key_of
from .registry import SQLRegistry

__all__ = ["SQLStored"]

#: The counter's row in ``<prefix>meta``.
VERSION_ROW = "stored_version"


class _Refused(Exception):
    """Raised inside a write's transaction to roll it back: its ``exists``
    condition did not hold."""


class SQLStored(SQLRegistry, StoredJobsStore):
    """Stored-job definitions and pause states in ``<prefix>stored``."""

    def stored_version(self) -> int:
        """The change counter (one primary-key SELECT), 0 before any write.

        Raises:
            BackendUnavailable: no answer.
        """
        meta = self._tables.meta
        with self._read("read the stored-jobs version") as conn:
            value = conn.execute(sa.select(meta.c.value).where(meta.c.name == VERSION_ROW)).scalar()
        return int(value) if value is not None else 0

    def stored_changes(self, since: int = 0) -> list[StoredRecord]:
        """Every record written after version ``since``, oldest first.

        Raises:
            BackendUnavailable: no answer.
        """
        t = self._tables.stored
        query = (
            sa.select(t.c.kind, t.c.full_name, t.c.body, t.c.version, t.c.committed_ms, t.c.prior)
            .where(t.c.version > since)
            .order_by(t.c.version)
        )
        with self._read("read stored jobs") as conn:
            rows = conn.execute(query).all()
        return [StoredRecord(k, n, b, int(v), int(c), parse_prior(p)) for k, n, b, v, c, p in rows]

    def stored_records(self, names: Sequence[str], kind: str) -> dict[str, StoredRecord]:
        """The current records of ``names`` of one ``kind`` (removed ones left out).

        Raises:
            BackendUnavailable: no answer.
        """
        t = self._tables.stored
        keys = [key_of(n) for n in names]
        found: dict[str, StoredRecord] = {}
        with self._read("read stored jobs") as conn:
            for start in range(0, len(keys), 500):
                rows = conn.execute(
                    sa.select(
                        t.c.full_name, t.c.body, t.c.version, t.c.committed_ms, t.c.prior
                    ).where(
                        t.c.kind == kind,
                        t.c.name.in_(keys[start : start + 500]),
                        t.c.body.is_not(None),
                    )
                ).all()
                for name, body, version, committed, prior in rows:
                    found[name] = StoredRecord(
                        kind, name, body, int(version), int(committed), parse_prior(prior)
                    )
        return found

    def write_stored_many(self, writes: Sequence[StoredWrite]) -> list[StoredRecord | None] | None:
        """Write records under the next versions, all or none, in one
        transaction that holds the counter's row lock (module docstring).

        Returns:
            one record per write (None for a removal of a record that is
            not there: nothing to write), or None when some ``exists`` did
            not hold (nothing was written).
        Raises:
            BackendUnavailable: no answer (the transaction is rolled back
                unless it committed).
        """
        try:
            return self._write_many(writes)
        except _Refused:
            return None

    def _write_many(self, writes: Sequence[StoredWrite]) -> list[StoredRecord | None]:
        t = self._tables.stored
        with self._write("write a stored job") as conn:
            version = self._next_version(conn, 0)  # its lock first: writers queue on it
            currents = []
            for w in writes:
                current = conn.execute(
                    sa.select(t.c.body, t.c.version, t.c.committed_ms, t.c.prior).where(
                        t.c.kind == w.kind, t.c.name == key_of(w.name)
                    )
                ).first()
                present = current is not None and current[0] is not None
                if w.exists is not None and present != w.exists:
                    raise _Refused  # rolls everything back
                currents.append(current)
            now = self._now(conn)
            written: list[StoredRecord | None] = []
            for w, current in zip(writes, currents, strict=True):
                if current is None and w.body is None:
                    written.append(None)  # nothing to remove
                    continue
                version += 1
                written.append(self._write_row(conn, w, current, version, now))
            if any(written):
                self._set_version(conn, version)  # once for the batch, under the same lock
        return written

    def _set_version(self, conn: Connection, version: int) -> None:
        meta = self._tables.meta
        update = sa.update(meta).where(meta.c.name == VERSION_ROW)
        conn.execute(update.values(value=str(version)))

    def _write_row(
        self, conn: Connection, w: StoredWrite, current: Any, version: int, now: int
    ) -> StoredRecord:
        t = self._tables.stored
        key = key_of(w.name)
        prior: tuple[tuple[int, int], ...] = ()
        if current is not None:
            earlier = ((int(current[1]), int(current[2])), *parse_prior(current[3]))
            prior = earlier[:PRIOR_WRITES]
        values = {
            "full_name": w.name,
            "body": w.body,
            "version": version,
            "committed_ms": now,
            "prior": prior_text(prior),
        }
        if current is None:
            conn.execute(sa.insert(t).values(kind=w.kind, name=key, **values))
        else:
            conn.execute(sa.update(t).where(t.c.kind == w.kind, t.c.name == key).values(values))
        return StoredRecord(w.kind, w.name, w.body, version, now, prior)

    def _next_version(self, conn: Connection, step: int = 1) -> int:
        """Lock the counter's row (made on the first write) and move it on
        by ``step``; the counter's new value."""
        meta = self._tables.meta
        row = {"name": VERSION_ROW, "value": "0"}
        locked = sa.select(meta.c.value).where(meta.c.name == VERSION_ROW)
        if self.kind != "sqlite":
            locked = locked.with_for_update()
        value = conn.execute(locked).scalar()
        if value is None:
            self._insert_if_absent(conn, meta, row)
            value = conn.execute(locked).scalar()
        version = int(value or 0) + step
        if step:
            self._set_version(conn, version)
        return version
