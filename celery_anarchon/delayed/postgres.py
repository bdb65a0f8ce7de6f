"""Parked tasks in PostgreSQL: one table indexed on the time a task can be
taken, claimed with ``FOR UPDATE SKIP LOCKED`` under a lease and a fencing
token (docs/delayed-tasks.md).

The store lives beside an :class:`~celery_anarchon.backends.sql.SQLBackend`'s
tables under the same prefix ``P``, and leaves those tables and their schema
version alone; it creates its own on first use:

* ``P delayed``: one row per parked task. ``ready_ms`` is when it can be
  taken, epoch ms (UTC): its due time while pending, its lease's expiry
  while in flight. ``token`` is 0 while pending, else the fencing token of
  the lease (from the sequence ``P delayed_token``, so a row's tokens only
  grow, across give-backs and take-overs alike). ``key`` is unique (NULLs
  are distinct); ``ready_ms`` is indexed.
* ``P delayed_started``: the worker gate's marks, ``id`` and
  ``keep_until_ms``; a mark past its ``keep_until_ms`` counts as absent and
  is purged now and then (:data:`~celery_anarchon.delayed.sql.PURGE_EVERY_S`).

Every statement runs through the backend's bounded transactions, and every
"now" is the database's ``clock_timestamp()`` in whole milliseconds (the
backend's clock), never this host's. What each method guarantees, and how:

* :meth:`PostgresDelayedStore.take_due` is one statement
  (:data:`TAKE_SQL`): the due rows are locked with ``FOR UPDATE SKIP
  LOCKED``, so concurrent takers never wait on each other and never take one
  row twice; a row changed by another taker after the statement's snapshot
  is re-checked against ``ready_ms <= now`` before it is locked (PostgreSQL's
  READ COMMITTED re-check), so a row just taken, finished or cancelled is
  skipped.
* :meth:`~PostgresDelayedStore.finish` and
  :meth:`~PostgresDelayedStore.give_back` act on ``id = ? AND token = ?``
  only: a lease taken over has another token.
* :meth:`~PostgresDelayedStore.cancel` and
  :meth:`~PostgresDelayedStore.reschedule` are one conditional ``DELETE`` /
  ``UPDATE .. WHERE token = 0``: against a concurrent take one of the two
  waits for the other's row lock and then re-checks, so a task is either
  cancelled or released, never both.
* :meth:`~PostgresDelayedStore.park` inserts with ``ON CONFLICT DO
  NOTHING``: a second insert of a key waits for the first's commit and then
  writes nothing, and the id it answers is read back (READ COMMITTED sees the
  first's row), so two concurrent parks of one key answer the same id.

Announcements: a park or reschedule that makes a task due before what was the
earliest ``ready_ms`` (or into an empty table) sends one ``NOTIFY`` on
``P delayed_wake`` per transaction, carrying that due time; a park that is
not earlier sends nothing, so thousands of parks a second do not queue on
PostgreSQL's notification lock. :meth:`~PostgresDelayedStore.listener` is a
``LISTEN`` on a psycopg connection of its own (psycopg 3.2 or later).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg import sql as pg_sql
from sqlalchemy.dialects import postgresql as postgresql_sql
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateIndex, CreateTable

from ..backends.sql import SQLBackend
from ..backends.sql.dialects import _NOW_SQL
from ..exceptions import BackendUnavailable, ConfigurationError
from .model import Parked, Taken
from .sql import ERROR_CHARS, SQLStore, chunks, key_order, row_taken
from .store import Listener

__all__ = ["MAX_KEY_BYTES", "PostgresDelayedStore"]

logger = logging.getLogger(__name__)

#: The database clock, epoch ms (UTC), as the backend reads it: the whole
#: milliseconds of ``clock_timestamp()`` (rounded down, so a task is never
#: judged due early).
NOW_SQL = _NOW_SQL["postgresql"]

#: Longest key, bytes of UTF-8: a unique B-tree entry must fit a third of an
#: 8 kB page (2,704 bytes after compression; PostgreSQL's
#: ``BTMaxItemSize``), so longer keys are refused before the round trip.
MAX_KEY_BYTES = 2000

# The claim of take_due (module docstring). ``now`` is read once (an
# InitPlan, so the ``ready_ms`` index serves the range); ``due`` is
# materialized so its LIMIT and locks hold as written. Returns the taken
# rows, earliest first, with the token before (0: it was pending) and the
# ready_ms before (its due time, or the expired lease's end).
TAKE_SQL = """
WITH now AS MATERIALIZED (
    SELECT {now} AS ms
), due AS MATERIALIZED (
    SELECT id, token, ready_ms FROM {delayed}
    WHERE ready_ms <= (SELECT ms FROM now)
    ORDER BY ready_ms
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE {delayed} AS t
    SET token = nextval('{sequence}'),
        ready_ms = (SELECT ms FROM now) + :lease_ms,
        owner = :owner
    FROM due
    WHERE t.id = due.id
    RETURNING t.id, t.key, t.task, t.payload, t.attempts, t.error, t.token,
        due.token AS was_token, due.ready_ms AS was_ready_ms
)
SELECT taken.*, (SELECT ms FROM now) AS now_ms FROM taken ORDER BY was_ready_ms, id
"""

# One chunk of a park: insert what is absent (by id and by key) in the given
# order. Returns the rows inserted, each with the earliest ready_ms before
# the insert (``head``: every part of one statement sees the same snapshot);
# one row of NULLs but ``head_ms`` when nothing was inserted.
INSERT_SQL = """
WITH head AS MATERIALIZED (
    SELECT min(ready_ms) AS ms FROM {delayed}
), inserted AS (
    INSERT INTO {delayed} (id, key, task, payload, ready_ms, token, attempts, parked_ms)
    SELECT p.id, p.key, p.task, p.payload, p.due_ms, 0, 0, {now}
    FROM unnest(
        CAST(:ids AS text[]), CAST(:keys AS text[]), CAST(:tasks AS text[]),
        CAST(:payloads AS text[]), CAST(:dues AS bigint[])
    ) WITH ORDINALITY AS p(id, key, task, payload, due_ms, n)
    ORDER BY p.n
    ON CONFLICT DO NOTHING
    RETURNING id, key, ready_ms
)
SELECT inserted.id, inserted.key, inserted.ready_ms, head.ms AS head_ms
FROM head LEFT JOIN inserted ON true
"""

# finish: delete the rows whose lease is still current. Returns their ids.
FINISH_SQL = """
DELETE FROM {delayed} AS t
USING unnest(CAST(:ids AS text[]), CAST(:tokens AS bigint[])) AS f(id, token)
WHERE t.id = f.id AND t.token = f.token
RETURNING t.id
"""

# give_back: make the rows whose lease is still current pending again.
# Returns their ids.
GIVE_BACK_SQL = """
UPDATE {delayed} AS t
SET token = 0, ready_ms = :retry_at_ms, attempts = t.attempts + :counted,
    error = CASE WHEN :counted = 1 THEN :error ELSE t.error END, owner = NULL
FROM unnest(CAST(:ids AS text[]), CAST(:tokens AS bigint[])) AS f(id, token)
WHERE t.id = f.id AND t.token = f.token
RETURNING t.id
"""


def _quoted(name: str) -> str:
    """``name`` as a quoted identifier (the prefix is checked to be
    ``[A-Za-z_][A-Za-z0-9_]*``, so it holds no quote), which matches
    SQLAlchemy's spelling of the tables it creates in either case."""
    return f'"{name}"'


class PostgresDelayedStore(SQLStore):
    """Parked tasks in a PostgreSQL :class:`~celery_anarchon.backends.sql.SQLBackend`,
    under its prefix (the module docstring gives the tables and the
    guarantees).

    Raises, for every method: :class:`~celery_anarchon.exceptions.BackendUnavailable`
    when the database cannot be reached, fails, or does not answer within the
    backend's ``statement_timeout`` (plus a second); a write that raised it
    was rolled back unless it had committed.
    """

    kind = "postgresql"
    max_key_bytes = MAX_KEY_BYTES

    def __init__(self, backend: SQLBackend) -> None:
        """Prepare the store on ``backend`` (opened or not); nothing connects.

        Raises:
            ConfigurationError: the backend is not PostgreSQL.
        """
        if backend.kind != "postgresql":
            raise ConfigurationError(
                f"anarchon_backend: {backend.describe()} is {backend.kind}, and only a "
                "PostgreSQL SQL backend keeps delayed tasks; use a postgresql:// URL."
            )
        super().__init__(backend, fence=False)
        #: the fencing-token sequence
        self.sequence = f"{backend.prefix}delayed_token"
        #: the ``NOTIFY`` channel parks and earlier reschedules announce on
        self.channel = f"{backend.prefix}delayed_wake"
        names = {
            "delayed": _quoted(self._tables.delayed.name),
            "sequence": _quoted(self.sequence),
            "now": NOW_SQL,
        }
        self._take = sa.text(TAKE_SQL.format(**names))
        self._insert = sa.text(INSERT_SQL.format(**names))
        self._finish = sa.text(FINISH_SQL.format(**names))
        self._give_back = sa.text(GIVE_BACK_SQL.format(**names))

    # -- tables ------------------------------------------------------------------

    def _create_tables(self) -> None:
        """Create the tables, indexes and sequence when one is missing.

        One transaction under a transaction-scoped advisory lock of the
        prefix's, so concurrent creators queue and the later ones find
        everything there (``IF NOT EXISTS``); a store that finds every
        relation present (``to_regclass``) runs no DDL at all, so a busy
        table is never locked by a ``CREATE INDEX IF NOT EXISTS``.
        """
        relations = [self._tables.delayed.name, self._tables.started.name, self.sequence]
        for table in (self._tables.delayed, self._tables.started):
            relations += [str(index.name) for index in table.indexes]
        names = [_quoted(name) for name in relations]
        present = sa.select(*(sa.func.to_regclass(name).is_not(None) for name in names))
        with self.backend._read("look for the delayed tables") as conn:
            found = conn.execute(present).one()
        if not all(found):
            self._create_relations()

    def _create_relations(self) -> None:
        delayed, started = self._tables.delayed, self._tables.started
        lock = zlib.crc32(f"celery-anarchon:{delayed.name}".encode())
        with self.backend._write("create the delayed tables") as conn:
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(lock)))
            conn.execute(CreateTable(delayed, if_not_exists=True))
            conn.execute(
                sa.text(
                    f"CREATE SEQUENCE IF NOT EXISTS {_quoted(self.sequence)} "
                    f"OWNED BY {_quoted(delayed.name)}.token"
                )
            )
            conn.execute(CreateTable(started, if_not_exists=True))
            for table in (delayed, started):
                for index in table.indexes:
                    conn.execute(CreateIndex(index, if_not_exists=True))
        logger.info("anarchon: delayed tables %s* ready in %s", delayed.name, self.describe())

    def _notify(self, conn: Connection, due_ms: int) -> None:
        """Announce ``due_ms`` on :attr:`channel` (sent at commit)."""
        conn.execute(sa.select(sa.func.pg_notify(self.channel, str(due_ms))))

    def _target(self, key_or_id: str) -> Any:
        """The id of the task parked under ``key_or_id`` as a key, else
        ``key_or_id`` itself (as an SQL expression)."""
        by_key = self._tables.delayed.alias("by_key")
        keyed = sa.select(by_key.c.id).where(by_key.c.key == key_or_id).scalar_subquery()
        return sa.func.coalesce(keyed, key_or_id)

    # -- parking -----------------------------------------------------------------

    def park(self, tasks: Sequence[Parked]) -> list[str]:
        """Park ``tasks`` in one transaction; the id of each, in order.

        A task whose ``key`` names a parked task (pending or in flight) is
        not written and answers that task's id; a task whose ``id`` is
        parked already is not written either (nothing is overwritten) and
        answers its id. The rows go in ordered by key, so two concurrent
        batches of the same keys queue instead of deadlocking. One ``NOTIFY``
        when a task written is due before the earliest ``ready_ms`` that was
        there (or the table was empty).

        Raises:
            ValueError: a key or task id longer than :data:`MAX_KEY_BYTES`
                bytes of UTF-8 (nothing is parked).
            BackendUnavailable: no answer, or a task's conflicting row kept
                vanishing for :data:`PARK_ROUNDS` rounds; nothing is parked
                (the transaction is rolled back).
        """
        self._check_keys(tasks)
        with self._write("park delayed tasks") as conn:
            wake: int | None = None

            def insert(todo: list[Parked]) -> list[bool]:
                nonlocal wake
                inserted, earliest = self._insert_absent(conn, todo)
                if earliest is not None and (wake is None or earliest < wake):
                    wake = earliest
                return inserted

            answers = self._park_rounds(conn, tasks, key_order(tasks), insert)
            if wake is not None:
                self._notify(conn, wake)
        return [answer for answer in answers if answer is not None]

    def _insert_absent(
        self, conn: Connection, tasks: list[Parked]
    ) -> tuple[list[bool], int | None]:
        """Insert those of ``tasks`` that are absent, in order, in chunks of
        :data:`~celery_anarchon.delayed.sql.INSERT_ROWS` rows and
        :data:`~celery_anarchon.delayed.sql.INSERT_BYTES` bytes; per task
        whether it was inserted, and the earliest due time inserted when it
        is before what was the earliest (else None)."""
        inserted: list[bool] = []
        wake: int | None = None
        for chunk in chunks(tasks):
            rows = conn.execute(
                self._insert,
                {
                    "ids": [t.id for t in chunk],
                    "keys": [t.key for t in chunk],
                    "tasks": [t.task for t in chunk],
                    "payloads": [t.payload for t in chunk],
                    "dues": [int(t.due_ms) for t in chunk],
                },
            ).all()
            written = {(row.id, row.key) for row in rows if row.id is not None}
            for task in chunk:
                inserted.append((task.id, task.key) in written)
                written.discard((task.id, task.key))  # a repeat in the batch was not
            dues = [int(row.ready_ms) for row in rows if row.id is not None]
            head = rows[0].head_ms if rows else None
            if dues and (head is None or min(dues) < head):
                wake = min(dues) if wake is None else min(wake, *dues)
        return inserted, wake

    # -- changes by callers --------------------------------------------------------

    def cancel(self, key_or_id: str) -> bool:
        """Delete a pending task, found by key first, then by id: ``DELETE ..
        WHERE id = <target> AND token = 0``.

        Returns:
            True when it was pending and is now gone; False when no such
            task is parked, or it is in flight.
        """
        t = self._tables.delayed
        stmt = sa.delete(t).where(t.c.id == self._target(key_or_id), t.c.token == 0)
        with self._write("cancel a delayed task") as conn:
            return bool(conn.execute(stmt).rowcount == 1)

    def reschedule(self, key_or_id: str, due_ms: int) -> bool:
        """Move a pending task (by key first, then by id) to ``due_ms``
        (epoch ms, UTC): ``UPDATE .. WHERE id = <target> AND token = 0``;
        announced when it is now due before what was the earliest.

        Returns:
            True when it was pending; False when no such task is parked, or
            it is in flight.
        """
        t = self._tables.delayed
        stmt = (
            sa.update(t)
            .where(t.c.id == self._target(key_or_id), t.c.token == 0)
            .values(ready_ms=int(due_ms))
        )
        with self._write("reschedule a delayed task") as conn:
            head = self._head_ms(conn)
            done = conn.execute(stmt).rowcount == 1
            if done and (head is None or due_ms < head):
                self._notify(conn, due_ms)
        return bool(done)

    # -- releasing ---------------------------------------------------------------

    def take_due(self, limit: int, lease_ms: int, owner: str) -> list[Taken]:
        """Take up to ``limit`` tasks due by the database clock, pending
        or in flight under an expired lease, each under a lease of
        ``lease_ms`` milliseconds for ``owner`` with a new fencing token, in
        one statement (:data:`TAKE_SQL`). Earliest first.

        Returns:
            one :class:`Taken` per task: ``task.due_ms`` is its ``ready_ms``
            before the take (the due time, or the expired lease's end),
            ``task.state`` is in flight, ``taken_over`` True when it was in
            flight, ``now_ms`` the database clock of the take.

        Now and then (:data:`~celery_anarchon.delayed.sql.PURGE_EVERY_S`) it
        then purges expired start marks, in a transaction of its own; a purge
        that fails is logged and does not fail the take.
        """
        if limit <= 0:
            return []
        params = {"limit": int(limit), "lease_ms": int(lease_ms), "owner": owner}
        with self._write("take due delayed tasks") as conn:
            rows = conn.execute(self._take, params).all()
        taken = [
            row_taken(
                row,
                token=row.token,
                was_token=row.was_token,
                was_ready_ms=row.was_ready_ms,
                now_ms=row.now_ms,
            )
            for row in rows
        ]
        self._purge_started()
        return taken

    def _fenced(self, stmt: Any, taken: Sequence[Taken], what: str, **params: Any) -> list[bool]:
        ids = [item.task.id for item in taken]
        tokens = [int(item.token) for item in taken]
        with self._write(what) as conn:
            done = set(conn.execute(stmt, {"ids": ids, "tokens": tokens, **params}).scalars())
        return [item.task.id in done for item in taken]

    def finish(self, taken: Sequence[Taken]) -> list[bool]:
        """Delete released tasks, one statement for the batch (:data:`FINISH_SQL`):
        per task True when its lease was still current (``id`` and
        ``token`` matched), False when another releaser took it over."""
        if not taken:
            return []
        return self._fenced(self._finish, taken, "finish delayed tasks")

    def give_back(
        self, taken: Sequence[Taken], retry_at_ms: int, error: str, *, failed: bool = True
    ) -> list[bool]:
        """Make tasks pending again at ``retry_at_ms`` (epoch ms, UTC); when
        ``failed`` (their publish failed), ``attempts`` counted up and
        ``error`` (its first :data:`ERROR_CHARS` characters) kept; else both
        left as they were. One statement for the batch
        (:data:`GIVE_BACK_SQL`); fenced as :meth:`finish`. Not announced: the
        releaser giving back is awake."""
        if not taken:
            return []
        return self._fenced(
            self._give_back,
            taken,
            "give back delayed tasks",
            retry_at_ms=int(retry_at_ms),
            error=error[:ERROR_CHARS].replace("\x00", "\ufffd"),  # text holds no NUL
            counted=1 if failed else 0,
        )

    # -- the worker's start gate ---------------------------------------------------

    def mark_started(self, task_id: str, keep_ms: int, owner: str = "") -> bool:
        """The worker's start gate: ``INSERT .. ON CONFLICT (id) DO UPDATE
        .. WHERE keep_until_ms <= now OR owner = :owner`` of a mark kept
        ``keep_ms`` milliseconds, made by the delivery ``owner``.

        Returns:
            True when no live mark of ``task_id`` was there (it is now), or
            the live one is ``owner``'s own (its earlier call committed and
            the answer was lost); False when another delivery's is.
        """
        s = self._tables.started
        now = sa.literal_column(NOW_SQL, sa.BigInteger)
        stmt = postgresql_sql.insert(s).values(
            id=task_id, keep_until_ms=now + max(1, int(keep_ms)), owner=owner or None
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[s.c.id],
            set_={"keep_until_ms": stmt.excluded.keep_until_ms, "owner": stmt.excluded.owner},
            where=(s.c.keep_until_ms <= now) | ((s.c.owner == owner) if owner else sa.false()),
        )
        options = {"preserve_rowcount": True}  # SQLAlchemy keeps an INSERT's only when asked
        with self._write("mark a delayed task started") as conn:
            return bool(conn.execute(stmt, execution_options=options).rowcount == 1)

    # -- push ----------------------------------------------------------------------

    def listener(self) -> Listener:
        """A ``LISTEN`` on :attr:`channel`, on a psycopg connection of its own
        (autocommit), listening when this returns.

        Raises:
            BackendUnavailable: the connection or the ``LISTEN`` failed.
        """
        engine = self.backend._ensure_open()
        conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        listener = _PostgresListener(
            conninfo, self.backend._postgres_args(), self.channel, self.describe()
        )
        listener.connect()
        return listener


class _PostgresListener(Listener):
    """``LISTEN`` on a connection of its own; a lost connection is reopened
    by the next :meth:`wait` (announcements meanwhile are missed: the
    releaser's poll covers them)."""

    def __init__(self, conninfo: str, options: dict[str, Any], channel: str, where: str) -> None:
        self._conninfo = conninfo
        #: libpq options: connect_timeout, keepalives, tcp_user_timeout, so a
        #: dead peer ends a wait with an error instead of silence
        self._options = options
        self._channel = channel
        self._where = where
        self._conn: psycopg.Connection[Any] | None = None

    def connect(self) -> psycopg.Connection[Any]:
        """Open the connection and ``LISTEN`` (once).

        Raises:
            BackendUnavailable: either failed.
        """
        if self._conn is not None:
            return self._conn
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True, **self._options)
        except psycopg.Error as exc:
            raise BackendUnavailable(f"{self._where}: LISTEN connection failed: {exc}") from exc
        try:
            conn.execute(pg_sql.SQL("LISTEN {}").format(pg_sql.Identifier(self._channel)))
        except psycopg.Error as exc:
            conn.close()
            raise BackendUnavailable(f"{self._where}: LISTEN failed: {exc}") from exc
        self._conn = conn
        return conn

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds for an announcement; True when
        one came (those that came with it are drained: one wake-up serves
        them all).

        Raises:
            BackendUnavailable: the connection is lost (it is closed; the
                next call reconnects).
        """
        conn = self.connect()
        try:
            # Each generator runs to its end: a suspended one holds the
            # connection's lock.
            woke = False
            for _ in conn.notifies(timeout=max(0.0, timeout_s), stop_after=1):
                woke = True
            if woke:
                for _ in conn.notifies(timeout=0):
                    pass
            return woke
        except psycopg.Error as exc:
            self.close()
            raise BackendUnavailable(f"{self._where}: LISTEN connection lost: {exc}") from exc

    def close(self) -> None:
        """Close the connection. Safe to call twice."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):  # the connection is gone already
                conn.close()
