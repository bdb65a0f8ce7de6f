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

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..store import PRIOR_WRITES, StoredJobsStore, StoredRecord, parse_prior, prior_text
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

    def write_stored(
        self, kind: str, name: str, body: str | None, *, exists: bool | None = None
    ) -> StoredRecord | None:
        """Write one record under the next version, in one transaction that
        holds the counter's row lock (see the module docstring).

        Returns:
            the record, or None when ``exists`` did not hold.
        Raises:
            BackendUnavailable: no answer (the transaction is rolled back
                unless it committed).
        """
        t = self._tables.stored
        key = key_of(name)
        try:
            return self._write_stored(t, kind, key, name, body, exists)
        except _Refused:
            return None

    def _write_stored(
        self, t: sa.Table, kind: str, key: str, name: str, body: str | None, exists: bool | None
    ) -> StoredRecord:
        with self._write("write a stored job") as conn:
            version = self._next_version(conn)
            current = conn.execute(
                sa.select(t.c.body, t.c.version, t.c.committed_ms, t.c.prior).where(
                    t.c.kind == kind, t.c.name == key
                )
            ).first()
            present = current is not None and current[0] is not None
            if exists is not None and present != exists:
                raise _Refused  # rolls the counter back
            now = self._now(conn)
            prior: tuple[tuple[int, int], ...] = ()
            if current is not None:
                earlier = ((int(current[1]), int(current[2])), *parse_prior(current[3]))
                prior = earlier[:PRIOR_WRITES]
            row = {
                "kind": kind,
                "name": key,
                "full_name": name,
                "body": body,
                "version": version,
                "committed_ms": now,
                "prior": prior_text(prior),
            }
            if current is None:
                conn.execute(sa.insert(t).values(row))
            else:
                conn.execute(
                    sa.update(t)
                    .where(t.c.kind == kind, t.c.name == key)
                    .values(
                        body=body,
                        version=version,
                        committed_ms=now,
                        full_name=name,
                        prior=row["prior"],
                    )
                )
        return StoredRecord(kind, name, body, version, now, prior)

    def _next_version(self, conn: Connection) -> int:
        """Lock the counter's row (made on the first write) and move it on."""
        meta = self._tables.meta
        row = {"name": VERSION_ROW, "value": "0"}
        locked = sa.select(meta.c.value).where(meta.c.name == VERSION_ROW)
        if self.kind != "sqlite":
            locked = locked.with_for_update()
        value = conn.execute(locked).scalar()
        if value is None:
            self._insert_if_absent(conn, meta, row)
            value = conn.execute(locked).scalar()
        version = int(value or 0) + 1
        conn.execute(sa.update(meta).where(meta.c.name == VERSION_ROW).values(value=str(version)))
        return version
