"""Parked tasks in an SQL backend: what every SQL store shares (the tables,
a row as a :class:`ParkedTask`, chunks, the reads), and the store of
MySQL/MariaDB and SQLite (docs/delayed-tasks.md).

The store lives beside an :class:`~celery_anarchon.backends.sql.SQLBackend`'s
tables under the same prefix ``P``, and leaves those tables and their schema
version alone; it creates its own on first use:

* ``P delayed``: one row per parked task. ``ready_ms`` is when it can be
  taken, epoch ms (UTC): its due time while pending, its lease's expiry
  while in flight. ``token`` is 0 while pending, else the fencing token of
  the lease. ``key`` is unique (NULLs are distinct); ``ready_ms`` is
  indexed.
* ``P delayed_started``: the worker gate's marks, ``id`` and
  ``keep_until_ms``; a mark past its ``keep_until_ms`` counts as absent and
  is purged now and then (:data:`PURGE_EVERY_S`).
* ``P delayed_fence`` (MySQL and SQLite; PostgreSQL has a sequence): one
  row, ``name = 'token'``, whose ``value`` is the last fencing token handed
  out.

On MySQL/MariaDB, ``id`` and ``key`` are ``VARBINARY`` (UTF-8, compared
byte for byte: the default collations would make ``Order`` equal ``order
``) of at most :data:`MAX_KEY_BYTES` bytes, the text columns ``utf8mb4``
(the payload ``LONGTEXT``), InnoDB, ``ROW_FORMAT=DYNAMIC``.

Every statement runs through the backend's bounded transactions (MySQL:
``READ COMMITTED``; SQLite: writes under ``BEGIN IMMEDIATE``), and every
"now" is the backend's clock: MySQL ``UTC_TIMESTAMP(6)`` in whole
milliseconds (one value per statement), SQLite this process's clock (SQLite
serves one host).

Deadlocks (MySQL/MariaDB). InnoDB breaks a deadlock at once by rolling one
of its transactions back whole, with error 1213, and the manual's remedy is
to run that transaction again
(https://dev.mysql.com/doc/refman/8.4/en/innodb-error-handling.html,
https://mariadb.com/docs/all/ref/mdb/error-codes/ER_LOCK_DEADLOCK/). So
every write of the store is one transaction whose body runs afresh on each
attempt (:meth:`SQLStore._transaction`): a victim runs again, up to
:data:`DEADLOCK_ATTEMPTS` times in all, after a random wait of up to 20,
40, 80, 160 ms, logged at DEBUG (INFO when it still fails); then it raises
BackendUnavailable as any failure does. Running it again is sound because
nothing of the victim stayed (the server rolled it back; no answer was
given) and each body decides from its own locking reads. A lock wait
timeout (1205) is not retried: the server rolled back only the waiting
statement (``innodb_rollback_on_timeout`` is off by default; the backend
then rolls back the rest), but it means a lock was held for the whole
``innodb_lock_wait_timeout`` (the backend's ``statement_timeout``), so
another attempt would most likely wait as long again, past the bound the
caller was promised; it is BackendUnavailable at once.

Fewer deadlocks, by locking in one order: a park takes the ``key`` index
entry of a task before its row (a duplicate key is checked, then its row
updated as a no-op), and goes keyless tasks first (by id: InnoDB keeps NULL
keys first), then by key, the index's order (:func:`park_order`).
:meth:`~SQLDelayedStore.finish` and :meth:`~SQLDelayedStore.give_back` lock
the same way: keyless rows by id through the primary key, then keyed rows
by key through the ``key`` index (entry, then row), and a finish deletes
row by row (``DELETE .. WHERE id = ?``, a primary-key lookup: a ``DELETE
.. WHERE id IN (..)`` was seen deadlocking with another one on rows
neither named). Statements that lock by a list force their index (``FORCE
INDEX``): on a small table the optimizer prefers a full scan, which would
lock in the table's order. A take locks the fence row first, so
concurrent takes queue on it holding nothing else. ``READ COMMITTED``
(the backend's, for every transaction) helps too: searches take no gap
locks (only duplicate-key checks do) and a locking read releases the rows
that did not match; it is sound here because every decision is made on a
locking read or by the writing statement's own ``WHERE``, never on a
snapshot.

What each method of :class:`SQLDelayedStore` guarantees, and how:

* :meth:`~SQLDelayedStore.take_due` is one transaction: the fence row
  locked (``SELECT .. FOR UPDATE``, MySQL), ``SELECT .. WHERE
  ready_ms <= now ORDER BY ready_ms, id LIMIT n FOR UPDATE SKIP LOCKED``
  (MySQL 8.0 and MariaDB 10.6 or later), which locks the due rows and skips
  those another taker holds, so concurrent takers never wait on each other
  nor take one row twice (a locking read judges the latest committed row,
  so a row just taken, finished or cancelled is not taken); then the fence
  row's ``UPDATE .. SET value = value + 1`` and its read; then ``UPDATE ..
  SET token = <that value>, ready_ms = now + lease WHERE id IN (<the ids
  locked>)``. MariaDB refuses ``UPDATE .. RETURNING`` and a ``LIMIT`` in an
  ``IN`` subquery, hence the three steps. On SQLite the same statements run
  without the lock clause (SQLite has none): ``BEGIN IMMEDIATE`` takes the
  database's write lock before the ``SELECT``, so no other writer runs
  between it and the ``UPDATE``.
* Fencing tokens only grow: the fence row is updated in the transaction
  that writes the token into the rows, under its row lock (SQLite: the
  write lock), so takes get their values one after the other, each above
  every value committed before; a take that rolls back wrote its value
  nowhere. All rows of one take share its token; a row's token is above any
  it had before, across give-backs and take-overs alike.
* :meth:`~SQLDelayedStore.finish` and :meth:`~SQLDelayedStore.give_back`
  read ``id, token`` of the rows named, locked (``FOR UPDATE``), and delete
  or update only those whose ``token`` is the lease's: a lease taken over
  has another token.
* :meth:`~SQLDelayedStore.cancel` and :meth:`~SQLDelayedStore.reschedule`
  find the id (by key, locked), then ``DELETE`` / ``UPDATE .. WHERE id = ?
  AND token = 0``: against a concurrent take one of the two waits for the
  other's row lock, and the later one judges the committed row, so a task
  is either cancelled or released, never both.
* :meth:`~SQLDelayedStore.park` inserts with ``INSERT .. ON DUPLICATE KEY
  UPDATE id = id`` (MySQL, a no-op on a duplicate id or key) or ``INSERT ..
  ON CONFLICT DO NOTHING`` (SQLite), in the ``key`` index's order
  (:func:`park_order`); a second insert of a key
  waits for the first's commit and then writes nothing. When the affected
  rows are fewer than the rows sent, the ids parked under the batch's keys
  and ids are read back (READ COMMITTED sees the first's row), so two
  concurrent parks of one key answer the same id.
* :meth:`~SQLDelayedStore.mark_started`: in one transaction, ``DELETE`` the
  task id's mark when it expired or is the asking delivery's own, then
  insert it if absent: a live mark of another delivery stays, and the
  insert affects no row.

Announcements: MySQL and SQLite have no push. :meth:`SQLDelayedStore.listener`
is woken by parks and reschedules made **in the same process** (on any
store of the same database and prefix) that are due before what was the
earliest; a park from another process is seen by the releaser's next look
at the store, at most ``anarchon_delayed_poll`` (2 s) later.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_sql
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.schema import CreateIndex, CreateTable

from ..backends.sql import SQLBackend
from ..backends.sql.naming import _Key, _kind_of
from ..exceptions import BackendUnavailable, ConfigurationError
from .model import IN_FLIGHT, PENDING, Parked, ParkedTask, Taken
from .store import DelayedStore, Listener

__all__ = ["MAX_KEY_BYTES", "SQLDelayedStore", "SQLStore", "DelayedTables"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest key (and task id), bytes of UTF-8, per dialect: MySQL/MariaDB
#: InnoDB index keys hold at most 3,072 bytes with the default 16 KB pages
#: and ``DYNAMIC`` rows (https://dev.mysql.com/doc/refman/8.4/en/innodb-limits.html,
#: https://mariadb.com/kb/en/innodb-dynamic-row-format/); SQLite has no
#: such limit (None).
MAX_KEY_BYTES: dict[str, int | None] = {"mysql": 3072, "sqlite": None}

#: Most rows, and most payload bytes, in one ``INSERT`` of a park; also the
#: most ids in one ``IN`` list.
INSERT_ROWS = 500
INSERT_BYTES = 4 * 1024 * 1024

#: Longest error text kept by a give-back, characters.
ERROR_CHARS = 1000

#: How often ``take_due`` purges expired start marks, seconds, and most
#: marks one purge deletes; a full purge lets the next ``take_due`` purge
#: again at once, so a backlog drains.
PURGE_EVERY_S = 60.0
PURGE_BATCH = 10_000

#: How often a park re-inserts a task whose conflicting row vanished (was
#: released or cancelled) between the insert and the read-back, before
#: giving up.
PARK_ROUNDS = 5

#: How many times a write transaction runs in all when MySQL/MariaDB chose
#: it as a deadlock victim (error 1213, the whole transaction rolled back),
#: and the backoff before a new attempt: a random wait of up to
#: ``DEADLOCK_BACKOFF_S * 2 ** (attempt - 1)`` seconds (the module docstring).
DEADLOCK_ATTEMPTS = 5
DEADLOCK_BACKOFF_S = 0.02

#: ``ER_LOCK_DEADLOCK``: InnoDB rolled the whole transaction back to break a
#: deadlock (https://dev.mysql.com/doc/refman/8.4/en/innodb-error-handling.html).
ER_LOCK_DEADLOCK = 1213

#: The fence row's name in ``P delayed_fence``.
FENCE_NAME = "token"

#: How long the first user of a MySQL database waits for another process
#: creating the delayed tables (``GET_LOCK``), seconds.
CREATE_LOCK_S = 30


class _Id(_Key):
    """A task id or key: ``TEXT`` on PostgreSQL and SQLite; on MySQL
    ``VARBINARY(3072)`` of UTF-8 (:data:`MAX_KEY_BYTES`), compared byte for
    byte as the backend's own keys are (:class:`~celery_anarchon.backends.sql.naming._Key`)."""

    impl = sa.Text  # type: ignore[assignment]  # _Key's is a String of 255
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        limit = MAX_KEY_BYTES["mysql"]
        if _kind_of(dialect.name) == "mysql" and limit is not None:
            return dialect.type_descriptor(mysql_sql.VARBINARY(limit))
        return sa.Text()  # not type_descriptor's: psycopg's maps TEXT to VARCHAR


#: MySQL table options: InnoDB (row locks, SKIP LOCKED), utf8mb4 text
#: compared exactly, DYNAMIC rows (3,072-byte index keys).
_MYSQL_TABLE: dict[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mysql_row_format": "DYNAMIC",
}


@dataclass(frozen=True)
class DelayedTables:
    """The store's tables under one prefix (the module docstring)."""

    metadata: sa.MetaData
    delayed: sa.Table
    started: sa.Table
    #: the fencing-token counter (MySQL, SQLite), or None (PostgreSQL: a sequence)
    fence: sa.Table | None

    @classmethod
    def under(cls, prefix: str, *, fence: bool) -> DelayedTables:
        metadata = sa.MetaData()
        delayed = sa.Table(
            f"{prefix}delayed",
            metadata,
            sa.Column("id", _Id(), primary_key=True),
            sa.Column("key", _Id(), nullable=True),
            sa.Column("task", sa.Text, nullable=False),
            sa.Column(
                "payload",
                sa.Text().with_variant(mysql_sql.LONGTEXT(), "mysql", "mariadb"),
                nullable=False,
            ),
            sa.Column("ready_ms", sa.BigInteger, nullable=False),
            sa.Column("token", sa.BigInteger, nullable=False, server_default="0"),
            sa.Column("owner", sa.Text, nullable=True),
            sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
            sa.Column("error", sa.Text, nullable=True),
            sa.Column("parked_ms", sa.BigInteger, nullable=False),
            sa.UniqueConstraint("key", name=f"{prefix}delayed_key"),
            sa.Index(f"{prefix}delayed_ready", "ready_ms"),
            **_MYSQL_TABLE,
        )
        started = sa.Table(
            f"{prefix}delayed_started",
            metadata,
            sa.Column("id", _Id(), primary_key=True),
            sa.Column("keep_until_ms", sa.BigInteger, nullable=False),
            sa.Column("owner", sa.Text, nullable=True),
            sa.Index(f"{prefix}delayed_started_keep", "keep_until_ms"),
            **_MYSQL_TABLE,
        )
        counter = None
        if fence:
            counter = sa.Table(
                f"{prefix}delayed_fence",
                metadata,
                sa.Column("name", sa.String(32), primary_key=True),
                sa.Column("value", sa.BigInteger, nullable=False),
                **_MYSQL_TABLE,
            )
        return cls(metadata, delayed, started, counter)

    def tables(self) -> list[sa.Table]:
        return [t for t in (self.delayed, self.started, self.fence) if t is not None]


def chunks(tasks: Sequence[Parked]) -> Iterator[list[Parked]]:
    """``tasks`` in runs of at most :data:`INSERT_ROWS` rows and
    :data:`INSERT_BYTES` payload characters (a single larger task alone)."""
    chunk: list[Parked] = []
    size = 0
    for task in tasks:
        if chunk and (len(chunk) >= INSERT_ROWS or size + len(task.payload) > INSERT_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(task)
        size += len(task.payload)
    if chunk:
        yield chunk


def _runs(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    """``ids`` in runs of at most :data:`INSERT_ROWS` (one ``IN`` list each)."""
    for start in range(0, len(ids), INSERT_ROWS):
        yield ids[start : start + INSERT_ROWS]


def row_task(row: Any) -> ParkedTask:
    """A row of ``P delayed`` (id, key, task, ready_ms, token, payload,
    attempts, error) as a :class:`ParkedTask`."""
    token = int(row.token)
    return ParkedTask(
        id=row.id,
        key=row.key,
        task=row.task,
        due_ms=int(row.ready_ms),
        state=IN_FLIGHT if token else PENDING,
        payload=row.payload,
        attempts=int(row.attempts),
        error=row.error,
        token=token,
    )


def row_taken(row: Any, *, token: int, was_token: int, was_ready_ms: int, now_ms: int) -> Taken:
    """A row just taken under ``token``: ``task.due_ms`` is ``was_ready_ms``
    (its due time, or the expired lease's end), taken over when
    ``was_token`` is not 0."""
    task = ParkedTask(
        id=row.id,
        key=row.key,
        task=row.task,
        due_ms=int(was_ready_ms),
        state=IN_FLIGHT,
        payload=row.payload,
        attempts=int(row.attempts),
        error=row.error,
        token=int(token),
    )
    return Taken(task, token=int(token), taken_over=int(was_token) != 0, now_ms=int(now_ms))


def key_order(tasks: Sequence[Parked]) -> list[int]:
    """The indexes of ``tasks`` by key (keyless ones after, by id): the
    order rows go in, so concurrent batches of the same keys queue instead
    of deadlocking."""
    return sorted(
        range(len(tasks)), key=lambda i: (tasks[i].key is None, tasks[i].key or tasks[i].id)
    )


def park_order(tasks: Sequence[Parked]) -> list[int]:
    """MySQL/MariaDB and SQLite: the indexes of ``tasks`` in the order of
    the ``key`` index, keyless ones first (by id: InnoDB keeps NULL entries
    first, by primary key), then by key (UTF-8 bytes order as code points
    do), so every park and every release locks index entries in one order
    (the module docstring)."""
    return sorted(
        range(len(tasks)), key=lambda i: (tasks[i].key is not None, tasks[i].key or tasks[i].id)
    )


def _deadlocked(exc: BaseException) -> bool:
    """True when ``exc`` (a BackendUnavailable from the backend) was caused
    by MySQL/MariaDB's deadlock error 1213 (:data:`ER_LOCK_DEADLOCK`)."""
    cause = exc.__cause__
    orig = getattr(cause, "orig", None) or cause
    if orig is None or not type(orig).__module__.startswith("pymysql"):
        return False
    args: tuple[Any, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] == ER_LOCK_DEADLOCK


def _by_index(stmt: Any, table: sa.Table, index: str) -> Any:
    """``stmt`` with ``FORCE INDEX (<index>)`` on MySQL (nothing elsewhere):
    on a small table the optimizer prefers a full scan, and a locking full
    scan waits for every row another transaction holds."""
    name = index if index == "PRIMARY" else "`" + index.replace("`", "``") + "`"
    hint = f"FORCE INDEX ({name})"
    if isinstance(stmt, sa.Select):
        return stmt.with_hint(table, hint, "mysql")
    return stmt.with_hint(hint, dialect_name="mysql")


class SQLStore(DelayedStore):
    """What every SQL store shares: the tables, the transactions, the reads
    and the purge of expired start marks. Subclasses create the tables
    (:meth:`_create_tables`) and write.

    Raises, for every method: :class:`~celery_anarchon.exceptions.BackendUnavailable`
    when the database cannot be reached, fails, or does not answer within the
    backend's ``statement_timeout`` (plus a second), or stays a deadlock
    victim for :data:`DEADLOCK_ATTEMPTS` attempts; a write that raised it
    was rolled back unless it had committed.
    """

    #: the longest key or task id park takes, bytes of UTF-8 (None: any)
    max_key_bytes: int | None = None

    def __init__(self, backend: SQLBackend, *, fence: bool) -> None:
        self.backend = backend
        self._tables = DelayedTables.under(backend.prefix, fence=fence)
        #: the unique index on ``key`` (its constraint's name)
        self._key_index = f"{backend.prefix}delayed_key"
        self._ready = False
        self._purge_after = 0.0

    def describe(self) -> str:
        """``delayed store in SQL (<kind>) <URL>``, the password masked."""
        return f"delayed store in {self.backend.describe()}"

    def now_ms(self) -> int:
        """The backend's clock, epoch ms (UTC)."""
        return self.backend.now_ms()

    def close(self) -> None:
        self.backend.close()

    # -- transactions and tables ----------------------------------------------

    @contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        self._ensure_tables()
        with self.backend._write(what) as conn:
            yield conn

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        self._ensure_tables()
        with self.backend._read(what) as conn:
            yield conn

    def _transaction(self, what: str, body: Callable[[Connection], T]) -> T:
        """``body(conn)`` in a write transaction (:meth:`_write`), run whole
        again when MySQL/MariaDB chose it as a deadlock victim (1213: the
        server rolled all of it back), up to :data:`DEADLOCK_ATTEMPTS` times
        in all, after a short random wait (the module docstring). ``body``
        must keep nothing from a failed attempt: each run starts afresh.

        Raises:
            BackendUnavailable: as :meth:`_write`; after the last attempt,
                the last deadlock's.
        """
        attempt = 1
        while True:
            try:
                with self._write(what) as conn:
                    return body(conn)
            except BackendUnavailable as exc:
                if attempt >= DEADLOCK_ATTEMPTS or not _deadlocked(exc):
                    if attempt > 1:
                        logger.info(
                            "anarchon: %s failed on attempt %d of %d: %s",
                            what,
                            attempt,
                            DEADLOCK_ATTEMPTS,
                            exc,
                        )
                    raise
                wait_s = random.uniform(0, DEADLOCK_BACKOFF_S * 2 ** (attempt - 1))
                logger.debug(
                    "anarchon: %s was a deadlock victim (attempt %d of %d); again in %.3fs",
                    what,
                    attempt,
                    DEADLOCK_ATTEMPTS,
                    wait_s,
                )
                time.sleep(wait_s)
                attempt += 1

    def _ensure_tables(self) -> None:
        if not self._ready:
            self._create_tables()
            self._ready = True

    def _create_tables(self) -> None:
        raise NotImplementedError

    def _absent(self) -> bool:
        """True when the store's database is not there (a SQLite file not
        made yet): the reads answer "nothing parked" without making it."""
        return False

    def _head_ms(self, conn: Connection) -> int | None:
        t = self._tables.delayed
        head = conn.execute(sa.select(sa.func.min(t.c.ready_ms))).scalar()
        return None if head is None else int(head)

    def _check_keys(self, tasks: Sequence[Parked]) -> None:
        """Refuse a key or id longer than :attr:`max_key_bytes` bytes."""
        limit = self.max_key_bytes
        if limit is None:
            return
        for task in tasks:
            for what, text in (("key", task.key), ("task id", task.id)):
                if text is not None and len(text.encode("utf-8")) > limit:
                    raise ValueError(
                        f"park {task.task}: the {what} is over {limit} bytes, more than "
                        f"{self.backend.kind}'s unique index takes; use a shorter {what} "
                        "(a hash of it)."
                    )

    def _park_rounds(
        self,
        conn: Connection,
        tasks: Sequence[Parked],
        order: list[int],
        insert: Callable[[list[Parked]], list[bool]],
    ) -> list[str | None]:
        """The id each of ``tasks`` is parked under, inserting them in
        ``order`` (indexes into ``tasks``) with ``insert`` (per task: True
        when written): a task not written conflicted with a row, whose id
        :meth:`_existing` reads back; one whose conflicting row vanished
        meanwhile is inserted again, for up to :data:`PARK_ROUNDS` rounds.

        Raises:
            BackendUnavailable: a conflicting row kept vanishing.
        """
        answers: list[str | None] = [None] * len(tasks)
        todo = order
        for _ in range(PARK_ROUNDS):
            if not todo:
                break
            inserted = insert([tasks[i] for i in todo])
            conflicts = [i for i, done in zip(todo, inserted, strict=True) if not done]
            for i, done in zip(todo, inserted, strict=True):
                if done:
                    answers[i] = tasks[i].id
            found = self._existing(conn, [tasks[i] for i in conflicts])
            for i, existing in zip(conflicts, found, strict=True):
                answers[i] = existing
            todo = [i for i in conflicts if answers[i] is None]
        if todo:
            raise BackendUnavailable(
                f"{self.describe()}: park of {tasks[todo[0]].id!r} kept conflicting with "
                f"a row that vanished before it could be read ({PARK_ROUNDS} rounds)"
            )
        return answers

    def _existing(self, conn: Connection, tasks: list[Parked]) -> list[str | None]:
        """For tasks that may not have been inserted: the id parked under
        the task's key, else the task's own id when that is parked, else
        None (the row it conflicted with is gone: insert again)."""
        if not tasks:
            return []
        t = self._tables.delayed
        keys = sorted({task.key for task in tasks if task.key is not None})
        ids = sorted({task.id for task in tasks})
        rows = conn.execute(
            sa.select(t.c.id, t.c.key).where(sa.or_(t.c.key.in_(keys), t.c.id.in_(ids)))
        ).all()
        by_key = {row.key: row.id for row in rows if row.key is not None}
        parked = {row.id for row in rows}
        found: list[str | None] = []
        for task in tasks:
            if task.key is not None and task.key in by_key:
                found.append(by_key[task.key])
            else:
                found.append(task.id if task.id in parked else None)
        return found

    # -- reading -----------------------------------------------------------------

    def _columns(self) -> list[Any]:
        t = self._tables.delayed
        return [
            t.c.id,
            t.c.key,
            t.c.task,
            t.c.ready_ms,
            t.c.token,
            t.c.payload,
            t.c.attempts,
            t.c.error,
        ]

    def get(self, key_or_id: str) -> ParkedTask | None:
        """The task parked under the key ``key_or_id``, else the one with
        that id, or None."""
        t = self._tables.delayed
        stmt = (
            sa.select(*self._columns())
            .where(sa.or_(t.c.key == key_or_id, t.c.id == key_or_id))
            .order_by(sa.case((t.c.key == key_or_id, 0), else_=1))
            .limit(1)
        )
        if self._absent():
            return None
        with self._read("read a delayed task") as conn:
            row = conn.execute(stmt).first()
        return None if row is None else row_task(row)

    def pending(self, limit: int, before_ms: int | None = None) -> list[ParkedTask]:
        """Up to ``limit`` parked tasks, pending and in flight, by
        ``ready_ms`` (the due time, or the lease's expiry), earliest first;
        only those with ``ready_ms`` before ``before_ms`` (epoch ms, UTC)
        when given."""
        if limit <= 0 or self._absent():
            return []
        t = self._tables.delayed
        stmt = sa.select(*self._columns()).order_by(t.c.ready_ms, t.c.id).limit(limit)
        if before_ms is not None:
            stmt = stmt.where(t.c.ready_ms < int(before_ms))
        with self._read("list delayed tasks") as conn:
            return [row_task(row) for row in conn.execute(stmt)]

    def count(self) -> int:
        """How many tasks are parked, pending and in flight (``count(*)``)."""
        t = self._tables.delayed
        if self._absent():
            return 0
        with self._read("count delayed tasks") as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one())

    def next_due_ms(self) -> int | None:
        """The least ``ready_ms`` (a pending task's due time or an in-flight
        lease's expiry), epoch ms (UTC), or None when nothing is parked."""
        if self._absent():
            return None
        with self._read("read the next delayed due time") as conn:
            return self._head_ms(conn)

    # -- the start marks' purge ------------------------------------------------

    def _purge_statement(self) -> Any:
        """Delete up to :data:`PURGE_BATCH` expired marks: ``DELETE .. WHERE
        id IN (SELECT .. LIMIT n)`` (PostgreSQL, SQLite)."""
        s = self._tables.started
        expired = s.alias("expired")
        now = self.backend._now_expr()
        return sa.delete(s).where(
            s.c.id.in_(
                sa.select(expired.c.id).where(expired.c.keep_until_ms <= now).limit(PURGE_BATCH)
            )
        )

    def _purge_started(self) -> None:
        """Delete up to :data:`PURGE_BATCH` expired start marks, at most
        every :data:`PURGE_EVERY_S` seconds (sooner while a purge finds a
        full batch); a purge that fails is logged and does not fail the
        caller."""
        if time.monotonic() < self._purge_after:
            return
        purged = 0
        try:
            purged = self._transaction(
                "purge delayed start marks",
                lambda conn: int(conn.execute(self._purge_statement()).rowcount),
            )
        except BackendUnavailable as exc:
            logger.warning("anarchon: purging expired start marks failed: %s", exc)
        self._purge_after = time.monotonic() + (0.0 if purged >= PURGE_BATCH else PURGE_EVERY_S)


# -- in-process wake-ups (MySQL and SQLite have no push) ----------------------------


class _Wakes:
    """The listeners of this process, by store (database and prefix)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, set[threading.Event]] = {}

    def add(self, topic: str, event: threading.Event) -> None:
        with self._lock:
            self._events.setdefault(topic, set()).add(event)

    def discard(self, topic: str, event: threading.Event) -> None:
        with self._lock:
            events = self._events.get(topic)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._events[topic]

    def listening(self, topic: str) -> bool:
        with self._lock:
            return topic in self._events

    def announce(self, topic: str) -> None:
        with self._lock:
            events = list(self._events.get(topic, ()))
        for event in events:
            event.set()


_WAKES = _Wakes()


class _LocalListener(Listener):
    """Woken by parks and reschedules of this process (:data:`_WAKES`);
    otherwise it only waits. Never loses a connection: it has none."""

    def __init__(self, topic: str) -> None:
        self._topic = topic
        self._event = threading.Event()
        _WAKES.add(topic, self._event)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for an announcement of this
        process; True when one came (those with it are drained)."""
        woke = self._event.wait(max(0.0, timeout_s))
        self._event.clear()
        return woke

    def close(self) -> None:
        """Stop listening. Safe to call twice."""
        _WAKES.discard(self._topic, self._event)


_SQLITE_WARNED: set[str] = set()


class SQLDelayedStore(SQLStore):
    """Parked tasks in a MySQL/MariaDB or SQLite
    :class:`~celery_anarchon.backends.sql.SQLBackend`, under its prefix (the
    module docstring gives the tables, the statements and the guarantees).
    SQLite serves one host: the store logs a warning saying so at first use.

    Raises, for every method: :class:`~celery_anarchon.exceptions.BackendUnavailable`
    as :class:`SQLStore` says.
    """

    def __init__(self, backend: SQLBackend) -> None:
        """Prepare the store on ``backend`` (opened or not); nothing connects.

        Raises:
            ConfigurationError: the backend is neither MySQL nor SQLite.
        """
        if backend.kind not in MAX_KEY_BYTES:
            raise ConfigurationError(
                f"anarchon_backend: {backend.describe()} is {backend.kind}; SQLDelayedStore "
                "keeps delayed tasks in MySQL/MariaDB or SQLite (PostgreSQL has its own)."
            )
        super().__init__(backend, fence=True)
        self.kind = backend.kind
        self.max_key_bytes = MAX_KEY_BYTES[backend.kind]
        #: where this process's announcements go: the database and the prefix
        self._topic = f"{backend.describe()} {backend.prefix}"

    # -- tables ------------------------------------------------------------------

    def _absent(self) -> bool:
        """True when the SQLite file is not there (yet): nothing is parked,
        and a read does not create it."""
        return not self.backend.exists()

    def _create_tables(self) -> None:
        """Create what is missing: tables, their indexes, the fence row
        (starting at the highest token present). SQLite: in one ``BEGIN
        IMMEDIATE`` transaction (concurrent creators queue on the write
        lock); MySQL: under ``GET_LOCK`` (DDL commits on its own). A store
        that finds every table runs no DDL."""
        names = [table.name for table in self._tables.tables()]
        with self.backend._read("look for the delayed tables") as conn:
            inspector = sa.inspect(conn)
            present = all(inspector.has_table(name) for name in names)
        if present and self._fence_ready():
            self._warn_if_local()
            return
        lock = f"celery-anarchon:{self._tables.delayed.name}"
        with self.backend._write("create the delayed tables") as conn:
            if self.kind == "mysql":
                got = conn.execute(sa.select(sa.func.get_lock(lock, CREATE_LOCK_S))).scalar()
                if got != 1:
                    raise BackendUnavailable(
                        f"{self.describe()}: another process held the lock {lock!r} for "
                        f"{CREATE_LOCK_S}s while creating the delayed tables"
                    )
            try:
                self._create_missing(conn)
            finally:
                if self.kind == "mysql":
                    conn.execute(sa.select(sa.func.release_lock(lock)))
        logger.info(
            "anarchon: delayed tables %s* ready in %s", self._tables.delayed.name, self.describe()
        )
        self._warn_if_local()

    def _create_missing(self, conn: Connection) -> None:
        inspector = sa.inspect(conn)
        for table in self._tables.tables():
            if not inspector.has_table(table.name):
                conn.execute(CreateTable(table, if_not_exists=True))
                inspector.clear_cache()
            indexes = {index["name"] for index in inspector.get_indexes(table.name)}
            for index in table.indexes:
                if index.name not in indexes:
                    conn.execute(CreateIndex(index))
        fence, t = self._tables.fence, self._tables.delayed
        assert fence is not None
        top = conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.c.token), 0))).scalar_one()
        self.backend._insert_if_absent(conn, fence, {"name": FENCE_NAME, "value": int(top)})

    def _fence_ready(self) -> bool:
        fence = self._tables.fence
        assert fence is not None
        with self.backend._read("read the fencing-token counter") as conn:
            row = conn.execute(sa.select(fence.c.value).where(fence.c.name == FENCE_NAME)).first()
        return row is not None

    def _warn_if_local(self) -> None:
        """The claim backend's SQLite warning, for parked tasks: once per
        file and process."""
        if self.kind != "sqlite" or self._topic in _SQLITE_WARNED:
            return
        _SQLITE_WARNED.add(self._topic)
        logger.warning(
            "anarchon: parked tasks are kept in a local SQLite file (%s): beats on this "
            "host never release one twice, but beats and clients on other hosts do not see "
            "them. To park and release on several hosts, set anarchon_backend (or "
            "anarchon_delayed_backend, for the parked tasks alone) to a shared Redis, "
            "PostgreSQL or MySQL URL.",
            self.backend._url.database,
        )

    def _now(self) -> Any:
        """The backend's clock as an SQL expression (MySQL), or this
        process's, epoch ms, as a bound value (SQLite)."""
        now = self.backend._now_expr()
        return sa.literal(now, sa.BigInteger) if isinstance(now, int) else now

    # -- parking -----------------------------------------------------------------

    def park(self, tasks: Sequence[Parked]) -> list[str]:
        """Park ``tasks`` in one transaction; the id of each, in order.

        A task whose ``key`` names a parked task (pending or in flight) is
        not written and answers that task's id; a task whose ``id`` is
        parked already is not written either (nothing is overwritten) and
        answers its id. The rows go in the ``key`` index's order
        (:func:`park_order`), so two concurrent batches of the same keys
        queue instead of deadlocking; a transaction MySQL still picks as a
        deadlock victim runs again (:meth:`SQLStore._transaction`). Announced to
        this process's listeners when a task is due before what was the
        earliest ``ready_ms`` (or the table was empty).

        Raises:
            ValueError: a key or task id longer than :data:`MAX_KEY_BYTES`
                bytes of UTF-8 (MySQL; nothing is parked).
            BackendUnavailable: no answer, or a task's conflicting row kept
                vanishing for :data:`PARK_ROUNDS` rounds; nothing is parked
                (the transaction is rolled back).
        """
        self._check_keys(tasks)
        listening = _WAKES.listening(self._topic)

        def body(conn: Connection) -> tuple[list[str | None], int | None]:
            head = self._head_ms(conn) if listening else None
            answers = self._park_rounds(
                conn, tasks, park_order(tasks), lambda todo: self._insert_absent(conn, todo)
            )
            return answers, head

        answers, head = self._transaction("park delayed tasks", body)
        if listening and tasks:
            earliest = min(int(task.due_ms) for task in tasks)
            if head is None or earliest < head:
                _WAKES.announce(self._topic)
        return [answer for answer in answers if answer is not None]

    def _insert_absent(self, conn: Connection, tasks: list[Parked]) -> list[bool]:
        """Insert those of ``tasks`` that are absent (by id and by key), in
        order, in chunks (:func:`chunks`); per task True when its chunk went
        in whole (affected rows = rows sent), else False (not known: read
        back)."""
        stmt = self.backend._insert_absent(self._tables.delayed).values(parked_ms=self._now())
        options = {"preserve_rowcount": True}  # SQLAlchemy keeps an INSERT's only when asked
        inserted: list[bool] = []
        for chunk in chunks(tasks):
            rows = [
                {
                    "id": task.id,
                    "key": task.key,
                    "task": task.task,
                    "payload": task.payload,
                    "ready_ms": int(task.due_ms),
                    "token": 0,
                    "attempts": 0,
                }
                for task in chunk
            ]
            count = conn.execute(stmt, rows, execution_options=options).rowcount
            inserted += [count == len(chunk)] * len(chunk)
        return inserted

    # -- changes by callers --------------------------------------------------------

    def _target(self, conn: Connection, key_or_id: str) -> str:
        """The id of the task parked under ``key_or_id`` as a key (its row
        locked, MySQL), else ``key_or_id`` itself."""
        t = self._tables.delayed
        by_key = sa.select(t.c.id).where(t.c.key == key_or_id).with_for_update()
        keyed = conn.execute(_by_index(by_key, t, self._key_index)).scalar()
        return key_or_id if keyed is None else str(keyed)

    def cancel(self, key_or_id: str) -> bool:
        """Delete a pending task, found by key first, then by id: ``DELETE ..
        WHERE id = <target> AND token = 0``.

        Returns:
            True when it was pending and is now gone; False when no such
            task is parked, or it is in flight.
        """
        t = self._tables.delayed
        if self._absent():
            return False

        def body(conn: Connection) -> bool:
            target = self._target(conn, key_or_id)
            stmt = sa.delete(t).where(t.c.id == target, t.c.token == 0)
            return bool(conn.execute(stmt).rowcount == 1)

        return self._transaction("cancel a delayed task", body)

    def reschedule(self, key_or_id: str, due_ms: int) -> bool:
        """Move a pending task (by key first, then by id) to ``due_ms``
        (epoch ms, UTC): ``UPDATE .. WHERE id = <target> AND token = 0``;
        announced to this process's listeners when it is now due before
        what was the earliest.

        Returns:
            True when it was pending; False when no such task is parked, or
            it is in flight.
        """
        t = self._tables.delayed
        if self._absent():
            return False
        listening = _WAKES.listening(self._topic)

        def body(conn: Connection) -> tuple[bool, int | None]:
            head = self._head_ms(conn) if listening else None
            target = self._target(conn, key_or_id)
            stmt = sa.update(t).where(t.c.id == target, t.c.token == 0).values(ready_ms=int(due_ms))
            return conn.execute(stmt).rowcount == 1, head

        done, head = self._transaction("reschedule a delayed task", body)
        if done and listening and (head is None or due_ms < head):
            _WAKES.announce(self._topic)
        return bool(done)

    # -- releasing ---------------------------------------------------------------

    def take_due(self, limit: int, lease_ms: int, owner: str) -> list[Taken]:
        """Take up to ``limit`` tasks due by the backend's clock, pending or
        in flight under an expired lease, each under a lease of ``lease_ms``
        milliseconds for ``owner`` with a new fencing token, in one
        transaction (the module docstring). Earliest first.

        Returns:
            one :class:`Taken` per task: ``task.due_ms`` is its ``ready_ms``
            before the take (the due time, or the expired lease's end),
            ``taken_over`` True when it was in flight, ``now_ms`` the
            backend's clock of the take.

        Now and then (:data:`PURGE_EVERY_S`) it then purges expired start
        marks, in a transaction of its own.
        """
        if limit <= 0:
            return []
        t = self._tables.delayed
        now = self._now()
        due = (
            sa.select(*self._columns(), now.label("now_ms"))
            .where(t.c.ready_ms <= now)
            .order_by(t.c.ready_ms, t.c.id)
            .limit(int(limit))
            .with_for_update(skip_locked=True)
        )

        def body(conn: Connection) -> list[Taken]:
            self._lock_fence(conn)
            rows = conn.execute(due).all()
            if not rows:
                return []
            now_ms = int(rows[0].now_ms)
            token = self._next_token(conn)
            for run in _runs(sorted(row.id for row in rows)):
                lease = (
                    sa.update(t)
                    .where(t.c.id.in_(run))
                    .values(token=token, ready_ms=now_ms + int(lease_ms), owner=owner)
                )
                conn.execute(_by_index(lease, t, "PRIMARY"))
            return [
                row_taken(
                    row,
                    token=token,
                    was_token=row.token,
                    was_ready_ms=row.ready_ms,
                    now_ms=now_ms,
                )
                for row in rows
            ]

        taken = self._transaction("take due delayed tasks", body)
        self._purge_started()
        return taken

    def _lock_fence(self, conn: Connection) -> None:
        """MySQL: lock the fence row (``SELECT .. FOR UPDATE``) before a take
        reads any due row, so concurrent takes queue on it holding nothing
        else: a take that first locked index entries of the due rows and then
        waited for the fence could deadlock with the take holding the fence
        and updating those rows. SQLite: nothing (the write lock is held)."""
        fence = self._tables.fence
        if self.kind != "mysql" or fence is None:
            return
        conn.execute(sa.select(fence.c.value).where(fence.c.name == FENCE_NAME).with_for_update())

    def _next_token(self, conn: Connection) -> int:
        """The next fencing token: the fence row counted up and read, in
        the caller's transaction (under its row lock until the commit).

        Raises:
            BackendUnavailable: the fence row is gone (deleted by hand).
        """
        fence = self._tables.fence
        assert fence is not None
        where = fence.c.name == FENCE_NAME
        changed = conn.execute(sa.update(fence).where(where).values(value=fence.c.value + 1))
        if changed.rowcount != 1:
            raise BackendUnavailable(
                f"{self.describe()}: the fencing-token row of {fence.name} is missing; "
                "restart beat to recreate it"
            )
        return int(conn.execute(sa.select(fence.c.value).where(where)).scalar_one())

    def _current(self, conn: Connection, taken: Sequence[Taken]) -> set[str]:
        """The ids of ``taken`` whose lease is still current (``id`` and
        ``token`` match), their rows locked (MySQL) until the commit: the
        keyless ones by id through the primary key, then the keyed ones by
        key through the ``key`` index, the order in which a park locks them
        (:func:`park_order`, the module docstring)."""
        t = self._tables.delayed
        wanted = {(item.task.id, int(item.token)) for item in taken if item.token > 0}
        tokens = sorted({token for _, token in wanted})
        keyless = sorted({item.task.id for item in taken if item.token > 0 and not item.task.key})
        keys = sorted({item.task.key for item in taken if item.token > 0 and item.task.key})
        current: set[str] = set()
        for column, index, run_of in (
            (t.c.id, "PRIMARY", keyless),
            (t.c.key, self._key_index, keys),
        ):
            for run in _runs(run_of):
                locked = (
                    sa.select(t.c.id, t.c.token)
                    .where(column.in_(run), t.c.token.in_(tokens))
                    .order_by(column)
                    .with_for_update()
                )
                rows = conn.execute(_by_index(locked, t, index))
                current.update(row.id for row in rows if (row.id, int(row.token)) in wanted)
        return current

    def _delete_ids(self, conn: Connection, ids: Sequence[str]) -> None:
        """Delete the rows of ``ids`` (locked already), one ``DELETE .. WHERE
        id = ?`` each, in id order (a primary-key lookup: no other row is
        read or locked)."""
        t = self._tables.delayed
        if ids:
            stmt = sa.delete(t).where(t.c.id == sa.bindparam("gone", type_=t.c.id.type))
            conn.execute(stmt, [{"gone": task_id} for task_id in sorted(ids)])

    def finish(self, taken: Sequence[Taken]) -> list[bool]:
        """Delete released tasks: per task True when its lease was still
        current (``id`` and ``token`` matched), False when another releaser
        took it over."""
        if not taken:
            return []

        def body(conn: Connection) -> set[str]:
            current = self._current(conn, taken)
            self._delete_ids(conn, sorted(current))
            return current

        current = self._transaction("finish delayed tasks", body)
        return [item.task.id in current for item in taken]

    def give_back(
        self, taken: Sequence[Taken], retry_at_ms: int, error: str, *, failed: bool = True
    ) -> list[bool]:
        """Make tasks pending again at ``retry_at_ms`` (epoch ms, UTC); when
        ``failed`` (their publish failed), ``attempts`` counted up and
        ``error`` (its first :data:`ERROR_CHARS` characters) kept; else both
        left as they were. Fenced as :meth:`finish`."""
        if not taken:
            return []
        t = self._tables.delayed
        values: dict[str, Any] = {"token": 0, "ready_ms": int(retry_at_ms), "owner": None}
        if failed:
            values.update(attempts=t.c.attempts + 1, error=error[:ERROR_CHARS])

        def body(conn: Connection) -> set[str]:
            current = self._current(conn, taken)
            for run in _runs(sorted(current)):
                back = sa.update(t).where(t.c.id.in_(run)).values(**values)
                conn.execute(_by_index(back, t, "PRIMARY"))
            return current

        current = self._transaction("give back delayed tasks", body)
        return [item.task.id in current for item in taken]

    # -- the worker's start gate ---------------------------------------------------

    def mark_started(self, task_id: str, keep_ms: int, owner: str = "") -> bool:
        """The worker's start gate, in one transaction: ``DELETE`` the mark
        of ``task_id`` when it expired (``keep_until_ms <= now``) or is
        ``owner``'s, then insert a mark kept ``keep_ms`` milliseconds if
        absent (MySQL ``ON DUPLICATE KEY UPDATE id = id``, SQLite ``ON
        CONFLICT DO NOTHING``).

        Returns:
            True when no live mark of ``task_id`` was there (it is now), or
            the live one is ``owner``'s own (its earlier call committed and
            the answer was lost); False when another delivery's is.
        """
        s = self._tables.started
        now = self._now()
        mine = (s.c.owner == owner) if owner else sa.false()
        forget = sa.delete(s).where(s.c.id == task_id, (s.c.keep_until_ms <= now) | mine)
        mark = self.backend._insert_absent(s).values(
            id=task_id, keep_until_ms=now + max(1, int(keep_ms)), owner=owner or None
        )
        options = {"preserve_rowcount": True}

        def body(conn: Connection) -> bool:
            conn.execute(forget)
            return bool(conn.execute(mark, execution_options=options).rowcount == 1)

        return self._transaction("mark a delayed task started", body)

    def _purge_statement(self) -> Any:
        """MySQL: ``DELETE .. WHERE keep_until_ms <= now ORDER BY
        keep_until_ms LIMIT n`` (MariaDB refuses a ``LIMIT`` in an ``IN``
        subquery); SQLite: :meth:`SQLStore._purge_statement`."""
        if self.kind != "mysql":
            return super()._purge_statement()
        s = self._tables.started
        return (
            sa.delete(s)
            .where(s.c.keep_until_ms <= self._now())
            .with_dialect_options(mysql_limit=PURGE_BATCH)
        )

    # -- push ----------------------------------------------------------------------

    def listener(self) -> Listener:
        """A listener woken by this process's parks and reschedules (no
        connection: MySQL and SQLite have no push)."""
        return _LocalListener(self._topic)
