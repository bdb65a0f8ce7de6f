"""What differs between SQLite, PostgreSQL and MySQL/MariaDB: the database
clock, conditional inserts, upserts and batched claim inserts.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_sql
from sqlalchemy.dialects import postgresql as postgresql_sql
from sqlalchemy.dialects import sqlite as sqlite_sql
from sqlalchemy.engine import Connection

from ..base import LeaseBackend
from .naming import _Tables

#: Most rows in one multi-row INSERT (well under SQLite's 32766 parameters).
INSERT_CHUNK = 500


#: Columns of a claim's first record (:meth:`SQLBackend._claim_row`), and the
#: element type of their PostgreSQL arrays when not BIGINT.
_CLAIM_COLUMNS = (
    "job",
    "slot_ms",
    "token",
    "state",
    "owner",
    "lease_until_ms",
    "keep_until_ms",
    "claimed_at_ms",
)


_ARRAY_TYPES: dict[str, Any] = {"job": sa.String, "state": sa.String, "owner": sa.Text}


# The database clock as integer epoch milliseconds, UTC. PostgreSQL's
# clock_timestamp() is the real time (now() is frozen at transaction start);
# extract(epoch ...) is exact numeric since PostgreSQL 14. MySQL's
# UTC_TIMESTAMP(6) does not depend on the session time zone.
_NOW_SQL = {
    "postgresql": "(floor(extract(epoch FROM clock_timestamp()) * 1000))::bigint",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
}


def _process_now_ms() -> int:
    """This process's clock, epoch milliseconds: SQLite's clock."""
    return time.time_ns() // 1_000_000


class SQLDialects(LeaseBackend):
    """The statements that differ by dialect (``self.kind``)."""

    #: ``"sqlite"``, ``"postgresql"`` or ``"mysql"`` (MariaDB included).
    kind: str
    _tables: _Tables
    #: the PostgreSQL claim insert, built once (:meth:`_unnest_insert`)
    _unnest_stmt: Any

    def _insert_claims(self, conn: Connection, rows: list[dict[str, Any]]) -> set[tuple[str, int]]:
        """Insert first records that are absent; the ``(job key, slot_ms)``
        of those inserted. SQLite and PostgreSQL: one multi-row statement per
        :data:`INSERT_CHUNK` rows (SQLAlchemy's "insertmanyvalues"), its
        ``RETURNING`` naming the rows inserted. MySQL: see
        :meth:`_insert_claims_mysql`."""
        runs = self._tables.runs
        if self.kind == "mysql":
            return self._insert_claims_mysql(conn, rows)
        stmt = self._insert_absent(runs).returning(runs.c.job, runs.c.slot_ms)
        won: set[tuple[str, int]] = set()
        for start in range(0, len(rows), INSERT_CHUNK):
            chunk = rows[start : start + INSERT_CHUNK]
            won.update((job, slot) for job, slot in conn.execute(stmt, chunk))
        return won

    def _insert_claims_postgresql(
        self, conn: Connection, rows: list[dict[str, Any]]
    ) -> set[tuple[str, int]]:
        """PostgreSQL, several claim rows (:meth:`_claim_row`): per
        :data:`INSERT_CHUNK` rows one ``INSERT .. SELECT .. FROM
        unnest(<an array per column>) WITH ORDINALITY .. ORDER BY <ordinal>
        ON CONFLICT DO NOTHING RETURNING job, slot_ms``: the rows go in the
        given (key) order, as from the multi-row ``VALUES`` of the others.
        Its text does not grow with the batch: psycopg parses the
        placeholders of a statement longer than its cache takes at every
        call, and a 500-row ``VALUES`` has 4,000 of them (about 0.1 ms of
        CPU per row here)."""
        won: set[tuple[str, int]] = set()
        stmt = self._unnest_insert()
        for start in range(0, len(rows), INSERT_CHUNK):
            chunk = rows[start : start + INSERT_CHUNK]
            params = {name: [row[name] for row in chunk] for name in _CLAIM_COLUMNS}
            won.update((job, slot) for job, slot in conn.execute(stmt, params))
        return won

    def _unnest_insert(self) -> Any:
        """The statement of :meth:`_insert_claims_postgresql` (built once)."""
        if self._unnest_stmt is None:
            runs = self._tables.runs
            arrays = [
                sa.bindparam(
                    name, type_=postgresql_sql.ARRAY(_ARRAY_TYPES.get(name, sa.BigInteger))
                )
                for name in _CLAIM_COLUMNS
            ]
            source = (
                sa.func.unnest(*arrays)
                .table_valued(*_CLAIM_COLUMNS, with_ordinality="n")
                .render_derived()
            )
            rows = sa.select(*(source.c[name] for name in _CLAIM_COLUMNS)).order_by(source.c.n)
            self._unnest_stmt = (
                postgresql_sql.insert(runs)
                .from_select(list(_CLAIM_COLUMNS), rows)
                .on_conflict_do_nothing()
                .returning(runs.c.job, runs.c.slot_ms)
            )
        return self._unnest_stmt

    def _insert_claims_mysql(
        self, conn: Connection, rows: list[dict[str, Any]]
    ) -> set[tuple[str, int]]:
        """MySQL has no ``RETURNING`` and one affected-row count per
        statement, so a batch is first tried as one multi-row statement under
        a savepoint: ``len(rows)`` affected means every row went in, 0 means
        none did; anything between cannot say which, so the savepoint is
        rolled back and each row inserted on its own (a batch that raced
        another instance's)."""
        runs = self._tables.runs
        keys = {(r["job"], r["slot_ms"]) for r in rows}
        if len(rows) > 1:
            savepoint = conn.begin_nested()
            options = {"preserve_rowcount": True}
            inserted = conn.execute(self._insert_absent(runs), rows, execution_options=options)
            if inserted.rowcount in (0, len(rows)):
                savepoint.commit()
                return keys if inserted.rowcount else set()
            savepoint.rollback()
        return {(r["job"], r["slot_ms"]) for r in rows if self._insert_if_absent(conn, runs, r)}

    def _insert_absent(self, table: sa.Table) -> Any:
        """The conditional insert into ``table`` (values bound at execution,
        so SQLAlchemy compiles it once): ``INSERT .. ON CONFLICT DO NOTHING``
        (SQLite, PostgreSQL); ``INSERT .. ON DUPLICATE KEY UPDATE <first key
        column> = <itself>`` (MySQL), a no-op on a duplicate."""
        if self.kind == "mysql":
            first = next(iter(table.primary_key.columns))
            return mysql_sql.insert(table).on_duplicate_key_update({first.name: first})
        if self.kind == "postgresql":
            return postgresql_sql.insert(table).on_conflict_do_nothing()
        return sqlite_sql.insert(table).on_conflict_do_nothing()

    def _insert_if_absent(self, conn: Connection, table: sa.Table, row: dict[str, Any]) -> bool:
        """Insert ``row`` unless its primary key exists; whether it was, by
        the affected-row count: 1 when inserted, 0 on a conflict (on MySQL,
        only with ``CLIENT_FOUND_ROWS`` off, see :meth:`_check_found_rows`)."""
        options = {"preserve_rowcount": True}
        result = conn.execute(self._insert_absent(table), row, execution_options=options)
        return bool(result.rowcount == 1)

    def _upsert(self, table: sa.Table, row: dict[str, Any]) -> Any:
        keys = {c.name for c in table.primary_key.columns}
        if self.kind == "mysql":
            stmt = mysql_sql.insert(table).values(row)
            return stmt.on_duplicate_key_update({k: stmt.inserted[k] for k in row if k not in keys})
        pg = postgresql_sql.insert(table) if self.kind == "postgresql" else sqlite_sql.insert(table)
        stmt2 = pg.values(row)
        return stmt2.on_conflict_do_update(
            index_elements=sorted(keys),
            set_={k: stmt2.excluded[k] for k in row if k not in keys},
        )

    @staticmethod
    def _process_now() -> int:
        """This process's clock, epoch ms: SQLite's (it has no server)."""
        return _process_now_ms()

    def _now(self, conn: Connection) -> int:
        """The database clock, epoch ms, read on ``conn``."""
        if self.kind == "sqlite":
            return _process_now_ms()
        return int(conn.execute(sa.text(f"SELECT {_NOW_SQL[self.kind]}")).scalar_one())

    def _now_expr(self) -> Any:
        """The database clock as an SQL expression (epoch ms)."""
        if self.kind == "sqlite":
            return _process_now_ms()
        return sa.literal_column(_NOW_SQL[self.kind], sa.BigInteger)
