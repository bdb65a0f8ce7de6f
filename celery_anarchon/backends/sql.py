"""SQL lease backend: SQLite, PostgreSQL and MySQL/MariaDB through SQLAlchemy Core.

Five tables, named with the ``prefix`` option (default ``anarchon_``):

=====================  ============================  ==========================================
table                  primary key                   holds
=====================  ============================  ==========================================
``<prefix>runs``       ``(job, slot_ms, token)``     one record per claim of a slot: state,
                                                     owner, lease, keep-until, timestamps,
                                                     task id, error, manual key
``<prefix>manual``     ``(job, manual_key)``         the slot each ``run_now`` key went to
``<prefix>instances``  ``instance``                  the live-instance registry (heartbeats)
``<prefix>schedules``  ``instance``                  each live instance's job definitions,
                                                     written once per schedule
``<prefix>meta``       ``name``                      ``schema_version`` (:data:`SCHEMA_VERSION`)
=====================  ============================  ==========================================

The first record of a slot always has token 1, so the key ``(job, slot_ms,
1)`` admits one first record per slot: that is the claim's unique key. A
takeover keeps the old record (now ``superseded``) and adds the next token's.
Job names, manual keys and instance ids are compared byte for byte (binary
columns on MySQL, whose default collations ignore case and trailing spaces).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import select
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_sql
from sqlalchemy.dialects import postgresql as postgresql_sql
from sqlalchemy.dialects import sqlite as sqlite_sql
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.schema import CreateTable

from ..exceptions import BackendUnavailable, ConfigurationError
from . import sanitize_url
from .base import AbsentRecord, Backend, Claim, ClaimRequest, InstanceInfo, RunRecord, State

__all__ = ["SCHEMA_VERSION", "SQLBackend"]

logger = logging.getLogger(__name__)

#: Version of the table layout, kept in ``<prefix>meta``; a later layout
#: migrates from it.
SCHEMA_VERSION = 1

#: Default history bounds for writes that carry none (``claim_manual``).
DEFAULT_HISTORY_SIZE = 100

#: URL driver names we accept -> the SQLAlchemy driver we use.
DRIVERS = {
    "sqlite": "sqlite",
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
    "mysql": "mysql+pymysql",
    "mysql+pymysql": "mysql+pymysql",
    "mariadb": "mysql+pymysql",
    "mariadb+pymysql": "mysql+pymysql",
}

#: Most characters of a job name, manual key or instance id stored as is;
#: longer ones are stored as a prefix plus their SHA-256 (see :func:`key_of`).
KEY_CHARS = 255

#: Most candidate milliseconds a manual run tries before giving up.
MANUAL_SLOT_TRIES = 100

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

#: A pooled connection idle for longer than this is pinged before use,
#: seconds; one used more recently only has its socket checked for a close
#: by the server (no round trip).
PING_AFTER_IDLE_S = 1.0

#: Jobs trimmed per transaction by :meth:`SQLBackend.housekeep`.
TRIM_CHUNK = 50

#: Most jobs whose trim waits for :meth:`SQLBackend.housekeep`, and the
#: longest one waits, seconds; past either, a write trims the oldest waiting
#: ones itself (a caller that stopped housekeeping never lets a history grow).
MAX_DEFERRED_TRIMS = 20_000
MAX_TRIM_WAIT_S = 60.0

#: ``CLIENT_FOUND_ROWS``, bit 2 of the MySQL client capability flags
#: (https://dev.mysql.com/doc/dev/mysql-server/latest/group__group__cs__capabilities__flags.html).
CLIENT_FOUND_ROWS = 2

_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}\Z")

# The database clock as integer epoch milliseconds, UTC. PostgreSQL's
# clock_timestamp() is the real time (now() is frozen at transaction start);
# extract(epoch ...) is exact numeric since PostgreSQL 14. MySQL's
# UTC_TIMESTAMP(6) does not depend on the session time zone.
_NOW_SQL = {
    "postgresql": "(floor(extract(epoch FROM clock_timestamp()) * 1000))::bigint",
    "mysql": "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)",
}

#: States that end a run.
FINISHED_STATES = (State.SUCCEEDED, State.FAILED, State.LOST)

#: The states mark() moves a run to, each with the states it moves from:
#: only forward along claimed < sent < running < succeeded/failed/lost. A
#: 'sent' reaching a run already past it (the worker was quicker) is a late
#: 'sent': it fills in sent_at_ms and task_id and leaves the state alone.
_MOVES_FROM = {
    State.SENT: (State.CLAIMED, State.SENT, State.RUNNING, *FINISHED_STATES),
    State.RUNNING: (State.CLAIMED, State.SENT),
    **{done: (State.CLAIMED, State.SENT, State.RUNNING) for done in FINISHED_STATES},
}

#: The timestamp column mark() sets for each state.
_STAMP = {
    State.SENT: "sent_at_ms",
    State.RUNNING: "started_at_ms",
    State.SUCCEEDED: "finished_at_ms",
    State.FAILED: "finished_at_ms",
    State.LOST: "finished_at_ms",
}

_DRIVER_ERRORS = (sa.exc.DBAPIError, sa.exc.TimeoutError, sa.exc.DisconnectionError)


def key_of(text: str) -> str:
    """The stored key for a job name, manual key or instance id.

    ``text`` itself when it has at most :data:`KEY_CHARS` characters and no
    NUL or lone surrogate (which PostgreSQL or UTF-8 cannot store); otherwise
    its first 190 storable characters, ``~`` and its SHA-256 in hex: distinct
    texts keep distinct keys, and every key fits a 255-character column.
    """
    if len(text) <= KEY_CHARS and _storable(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    head = "".join(c if _storable(c) else "?" for c in text[:190])
    return f"{head}~{digest}"


def _storable(text: str) -> bool:
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clean(text: str) -> str:
    """``text`` as a value every database stores (no NUL, valid UTF-8)."""
    if _storable(text):
        return text
    return text.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def _process_now_ms() -> int:
    """This process's clock, epoch milliseconds: SQLite's clock."""
    return time.time_ns() // 1_000_000


class _Key(sa.types.TypeDecorator[str]):
    """A key column compared byte for byte: ``VARCHAR(255)`` on SQLite and
    PostgreSQL, ``VARBINARY(1020)`` (UTF-8) on MySQL/MariaDB, whose default
    collations would make ``Job`` equal ``job `` and merge two jobs' slots."""

    impl = sa.String(KEY_CHARS)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> sa.types.TypeEngine[Any]:
        if _kind_of(dialect.name) == "mysql":
            return dialect.type_descriptor(mysql_sql.VARBINARY(4 * KEY_CHARS))
        return dialect.type_descriptor(sa.String(KEY_CHARS))

    def process_bind_param(self, value: str | None, dialect: Dialect) -> Any:
        if value is not None and _kind_of(dialect.name) == "mysql":
            return value.encode("utf-8")
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if isinstance(value, bytes | bytearray):
            return bytes(value).decode("utf-8")
        return value


def _kind_of(dialect_name: str) -> str:
    """``sqlite``, ``postgresql`` or ``mysql`` (MariaDB included)."""
    return "mysql" if dialect_name == "mariadb" else dialect_name


@dataclass(frozen=True)
class _Tables:
    metadata: sa.MetaData
    runs: sa.Table
    manual: sa.Table
    instances: sa.Table
    schedules: sa.Table
    meta: sa.Table


def _ms(name: str, **kw: Any) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger, autoincrement=False, **kw)


def _tables(prefix: str) -> _Tables:
    """The schema, every table named ``prefix + name``."""
    md = sa.MetaData()
    opts: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}
    runs = sa.Table(
        f"{prefix}runs",
        md,
        sa.Column("job", _Key(), primary_key=True),
        _ms("slot_ms", primary_key=True),
        _ms("token", primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.Text),
        _ms("lease_until_ms"),
        _ms("keep_until_ms", nullable=False),
        _ms("claimed_at_ms"),
        _ms("sent_at_ms"),
        _ms("started_at_ms"),
        _ms("finished_at_ms"),
        sa.Column("task_id", sa.Text),
        sa.Column("error", sa.Text),
        sa.Column("manual_key", sa.Text),
        **opts,
    )
    manual = sa.Table(
        f"{prefix}manual",
        md,
        sa.Column("job", _Key(), primary_key=True),
        sa.Column("manual_key", _Key(), primary_key=True),
        _ms("slot_ms", nullable=False),
        _ms("keep_until_ms", nullable=False),
        **opts,
    )
    instances = sa.Table(
        f"{prefix}instances",
        md,
        sa.Column("instance", _Key(), primary_key=True),
        sa.Column("info", sa.Text, nullable=False),
        _ms("heartbeat_ms", nullable=False),
        _ms("expires_ms", nullable=False),
        **opts,
    )
    schedules = sa.Table(
        f"{prefix}schedules",
        md,
        sa.Column("instance", _Key(), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("jobs", sa.Text, nullable=False),
        **opts,
    )
    meta = sa.Table(
        f"{prefix}meta",
        md,
        sa.Column("name", _Key(), primary_key=True),
        sa.Column("value", sa.String(255), nullable=False),
        **opts,
    )
    return _Tables(md, runs, manual, instances, schedules, meta)


def _seconds(name: str, value: Any) -> float:
    """A positive duration option in seconds (number, numeric string or
    ``timedelta``)."""
    try:
        seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds <= 3600:
        raise ConfigurationError(
            f"anarchon_backend_options[{name!r}]: expected seconds between 0 and 3600, "
            f"got {value!r}; e.g. {{{name!r}: 5}}."
        )
    return seconds


def _prefix(value: Any) -> str:
    if not isinstance(value, str) or not _PREFIX_RE.match(value):
        raise ConfigurationError(
            f"anarchon_backend_options['prefix']: {value!r} is not a usable table-name "
            "prefix; use letters, digits and '_' (at most 40, not starting with a digit), "
            "e.g. 'anarchon_'."
        )
    return value


def _in_window(request: ClaimRequest, now: int) -> bool:
    """Whether ``request.slot_ms`` lies in ``[now - window_before_ms, now +
    window_after_ms]`` (all epoch ms)."""
    return now - request.window_before_ms <= request.slot_ms <= now + request.window_after_ms


def _lost(job: str, slot_ms: int, reason: str) -> Claim:
    return Claim(job, slot_ms, won=False, token=None, reason=reason)


def _trim_every(history_size: int) -> int:
    """Writes of a job between two trims of its history."""
    return max(1, history_size // 10)


class SQLBackend(Backend):
    """Lease backend on SQLite, PostgreSQL or MySQL/MariaDB (SQLAlchemy Core).

    Construct with a URL (``sqlite:///path``, ``postgresql://`` or
    ``postgres://`` (psycopg 3), ``postgresql+psycopg://``, ``mysql://``,
    ``mysql+pymysql://``, ``mariadb://``: MySQL and MariaDB go through
    PyMySQL) or with ``client=`` an SQLAlchemy :class:`~sqlalchemy.engine.Engine`
    the user owns (then :meth:`close` never disposes it). Nothing connects
    before :meth:`open`, which creates the tables (see the module docstring)
    if missing; several processes may do so at once.

    Guarantees, and the statement that gives each:

    * **One winner per slot.** A claim is one conditional insert of the slot's
      first record (token 1) on the key ``(job, slot_ms, token)``: SQLite and
      PostgreSQL ``INSERT .. ON CONFLICT DO NOTHING RETURNING job, slot_ms``,
      one multi-row statement for a batch (PostgreSQL: rows from
      ``unnest`` of one array per column, see
      :meth:`_insert_claims_postgresql`); MySQL/MariaDB ``INSERT .. ON
      DUPLICATE KEY UPDATE job = job``, won when it affected one row (a batch
      goes as one multi-row statement when all or none of it is won, see
      :meth:`_insert_claims_mysql`). A no-op update affects 0 rows only
      without ``CLIENT_FOUND_ROWS``, which SQLAlchemy always sets: engines
      made here strip it, and :meth:`open` refuses a user's MySQL Engine
      that has it (strip it in a ``do_connect`` listener:
      ``cparams["client_flag"] &= ~2``). A batch is one transaction,
      inserted in key order so concurrent batches never deadlock.
    * **Claim window by the database clock**: PostgreSQL ``clock_timestamp()``,
      MySQL ``UTC_TIMESTAMP(6)``; SQLite has no server, so this process's
      clock (SQLite serves one host). A slot outside ``[now -
      window_before_ms, now + window_after_ms]`` is lost with ``"window"``.
    * **Fencing and forward-only states**: :meth:`mark` is ``UPDATE ..
      WHERE job, slot_ms, token = :token AND state IN (<states it may move
      from>)``, so a superseded record never changes and ``running`` is
      entered once (the worker's start gate).
    * **Takeover** (:meth:`take_over`): in one transaction, ``UPDATE .. SET
      state = 'superseded' WHERE token = :old AND state = 'claimed' AND
      lease_until_ms < now`` and, when that changed one row, insert token
      ``old + 1``.
    * **run_now once per key**: a conditional insert into ``<prefix>manual``
      on ``(job, manual_key)`` in the transaction that writes the run.
    * **Records outlive every late claimer**: trimming deletes only records
      whose ``keep_until_ms`` has passed (by the database clock).
    * **Short waits**: ``connect_timeout`` bounds connecting (PostgreSQL:
      at least 2 s, libpq's minimum; MySQL: the TCP connect, the server's
      greeting then waits up to ``statement_timeout``) and
      ``statement_timeout`` each statement (PostgreSQL ``statement_timeout``
      and ``tcp_user_timeout``; MySQL client read/write timeouts and
      ``innodb_lock_wait_timeout``; SQLite busy timeout). Pooled connections
      are pinged before use, so the backend recovers when the database
      comes back. Every driver error is raised as
      :class:`~celery_anarchon.exceptions.BackendUnavailable`. These
      settings apply to engines made here; a user's Engine keeps its own.

    SQLite runs in WAL mode and starts write transactions with ``BEGIN
    IMMEDIATE`` (engines made here), so processes on one host share a file.
    In-memory SQLite is refused: it cannot be shared between processes.
    MySQL engines made here use ``READ COMMITTED``.

    Fork-safe: in a process forked after connecting (a prefork worker), the
    first call gives the engine a fresh pool without closing the parent's
    connections.

    History is trimmed per job after writes, amortised: at every
    ``max(1, history_size // 10)``-th write of the job by this instance
    (at an offset of the job's own, so a burst's jobs are trimmed in
    different rounds; never before that many writes), one ``DELETE``
    removes its records older than
    ``history_ttl_ms`` (by slot) or beyond the newest ``history_size``,
    except those whose ``keep_until_ms`` is ahead; so between trims a job may
    hold up to ``history_size // 10`` records more. A trim runs in the
    writing call, after its transaction, unless the caller does
    housekeeping: once :meth:`housekeep` has been called (the scheduler calls
    it after each registry heartbeat), trims wait for its next call, off the
    claim path. A trim that fails is logged and retried later: it never
    fails the claim.

    Options (``anarchon_backend_options`` or URL query parameters):

    * ``prefix``: table name prefix, default ``anarchon_``;
    * ``connect_timeout``: seconds, default 5;
    * ``statement_timeout``: seconds, default 5.
    """

    supports_leases: ClassVar[bool] = True
    options: ClassVar[frozenset[str]] = frozenset(
        {"prefix", "connect_timeout", "statement_timeout"}
    )

    def __init__(
        self,
        url: str | None,
        *,
        client: Any = None,
        instance: str,
        prefix: str = "anarchon_",
        connect_timeout: float | str | timedelta = 5.0,
        statement_timeout: float | str | timedelta = 5.0,
    ) -> None:
        """Prepare the backend; nothing connects (see :meth:`open`).

        Raises:
            ConfigurationError: no URL nor Engine, a client that is not an
                Engine, an in-memory SQLite URL, an unsupported dialect, or
                a bad option value.
        """
        super().__init__(url, client=client, instance=instance)
        self.prefix = _prefix(prefix)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        self.statement_timeout = _seconds("statement_timeout", statement_timeout)
        self._tables = _tables(self.prefix)
        self._owns_engine = client is None
        self._engine: Engine | None = None
        self._pid = os.getpid()
        self._ready = False
        self._writes: dict[str, int] = {}
        #: job key -> (history_size, history_ttl_ms, waiting since (monotonic
        #: seconds)) of trims left to housekeep(), oldest first
        self._trims_due: dict[str, tuple[int, int, float]] = {}
        self._housekept = False
        self._unnest_stmt: Any = None
        if client is not None:
            if not isinstance(client, Engine):
                raise ConfigurationError(
                    f"anarchon_backend: SQLBackend needs an SQLAlchemy Engine as its client, "
                    f"not a {type(client).__name__}; pass create_engine(url) or the URL."
                )
            self._engine = client
            self._url = client.url
        elif url is None:
            raise ConfigurationError("anarchon_backend: give an SQL URL or an SQLAlchemy Engine.")
        else:
            self._url = _parse_url(url)
        self.kind = _kind_of(self._url.get_backend_name())
        if self.kind not in ("sqlite", "postgresql", "mysql"):
            raise ConfigurationError(
                f"anarchon_backend: {self._url.get_backend_name()!r} databases are not "
                "supported; use SQLite, PostgreSQL or MySQL/MariaDB."
            )

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """Connect, create the tables if missing and check the schema version.

        Idempotent, and safe to run from several processes at once: each
        table is created with ``CREATE TABLE IF NOT EXISTS``, and a creation
        that fails because another process just created the table is fine.

        Raises:
            BackendUnavailable: the database cannot be reached or fails.
            ConfigurationError: the SQLite file's directory does not exist; a
                user's MySQL Engine reports found rather than changed rows
                (``CLIENT_FOUND_ROWS``); a table of one of our names lacks
                our columns (another program's); the tables were made by a
                newer celery-anarchon (schema version above
                :data:`SCHEMA_VERSION`).
        """
        if self._ready:
            return
        if self._engine is None:
            self._check_sqlite_dir()
            self._engine = self._create_engine()
        with self._unavailable("open"):
            self._check_found_rows(self._engine)
            self._create_tables(self._engine)
            foreign = self._foreign_tables(self._engine)
            version = self._schema_version(self._engine) if not foreign else 0
        if foreign:
            raise ConfigurationError(
                f"anarchon_backend: {'; '.join(foreign)} in {self.describe()}: a table of that "
                "name exists but is not celery-anarchon's. Set "
                "anarchon_backend_options['prefix'] (or ?prefix= in the URL) to use other "
                "table names, or move that table away."
            )
        if version > SCHEMA_VERSION:
            raise ConfigurationError(
                f"anarchon_backend: the tables {self.prefix}* in {self.describe()} have "
                f"schema version {version}, made by a newer celery-anarchon (this one "
                f"knows {SCHEMA_VERSION}); upgrade celery-anarchon, or set "
                "anarchon_backend_options['prefix'] to use other tables."
            )
        self._ready = True
        logger.info("anarchon: SQL backend ready: %s", self.describe())

    def close(self) -> None:
        """Dispose of the engine this backend made; a user's Engine is left
        untouched. Safe to call twice; a later call reopens. In a process
        forked after connecting, the connections inherited from the parent
        are dropped without being closed (closing would end the parent's)."""
        engine, self._ready = self._engine, False
        if self._owns_engine and engine is not None:
            self._engine = None
            engine.dispose(close=self._pid == os.getpid())

    def describe(self) -> str:
        """``SQL (<kind>) <URL>`` with the password masked."""
        if self._owns_engine:
            shown = sanitize_url(self._url.render_as_string(hide_password=False))
        else:
            shown = self._url.render_as_string(hide_password=True)
        return f"SQL ({self.kind}) {shown}"

    # -- clock ---------------------------------------------------------------

    def now_ms(self) -> int:
        """The database clock, epoch milliseconds (UTC): PostgreSQL
        ``clock_timestamp()``, MySQL ``UTC_TIMESTAMP(6)``, SQLite this
        process's clock.

        Raises:
            BackendUnavailable: no answer.
        """
        if self.kind == "sqlite":
            return _process_now_ms()
        with self._read("read the clock") as conn:
            return self._now(conn)

    # -- claims --------------------------------------------------------------

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots in one transaction (see the class docstring for the
        statements), exactly one winner per ``(job, slot_ms)``.

        Returns:
            one :class:`Claim` per request, in request order: won with token
            1 (record ``claimed``, owner this instance, ``lease_until_ms =
            now + lease_ms``, ``keep_until_ms`` from the request); lost with
            ``"window"`` when outside the claim window by the database clock,
            ``"taken"`` when the slot has a record (or appears twice in the
            batch: the first wins).
        Raises:
            BackendUnavailable: no answer; treat every request as lost.
        """
        if not requests:
            return []
        with self._write("claim") as conn:
            now = self._now(conn)
            answers = self._claim_all(conn, requests, now)
        won = [r for r, a in zip(requests, answers, strict=True) if a.won]
        logger.debug("anarchon: claimed %d of %d slot(s)", len(won), len(requests))
        self._after_writes((key_of(r.job), r.history_size, r.history_ttl_ms) for r in won)
        return answers

    def _claim_all(
        self, conn: Connection, requests: Sequence[ClaimRequest], now: int
    ) -> list[Claim]:
        answers: dict[int, Claim] = {}
        rows: dict[tuple[str, int], tuple[int, dict[str, Any]]] = {}
        for i, req in enumerate(requests):
            slot = (key_of(req.job), req.slot_ms)
            if not _in_window(req, now):
                answers[i] = _lost(req.job, req.slot_ms, "window")
            elif slot in rows:
                answers[i] = _lost(req.job, req.slot_ms, "taken")
            else:
                rows[slot] = (i, self._claim_row(req, now, token=1))
        ordered = [rows[slot] for slot in sorted(rows)]
        claim_rows = [row for _, row in ordered]
        if self.kind == "postgresql" and len(claim_rows) > 1:
            won = self._insert_claims_postgresql(conn, claim_rows)
        else:
            won = self._insert_claims(conn, claim_rows)
        for i, row in ordered:
            req = requests[i]
            if (row["job"], row["slot_ms"]) in won:
                answers[i] = Claim(req.job, req.slot_ms, won=True, token=1)
            else:
                answers[i] = _lost(req.job, req.slot_ms, "taken")
        return [answers[i] for i in range(len(requests))]

    def _claim_row(self, req: ClaimRequest, now: int, token: int) -> dict[str, Any]:
        return {
            "job": key_of(req.job),
            "slot_ms": req.slot_ms,
            "token": token,
            "state": State.CLAIMED.value,
            "owner": self.instance,
            "lease_until_ms": now + req.lease_ms,
            "keep_until_ms": req.keep_until_ms,
            "claimed_at_ms": now,
        }

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

    def take_over(self, request: ClaimRequest) -> Claim:
        """Take over a slot whose winner's lease ran out (backup runner).

        One transaction: read the slot's current record (``FOR UPDATE``);
        when it is a scheduled run still ``claimed`` with ``lease_until_ms``
        before the database's now, ``UPDATE`` it to ``superseded`` fenced by
        its token, state and lease, and insert token ``old + 1`` owned by this
        instance (``keep_until_ms`` the later of the two). A slot with no
        record is claimed as by :meth:`claim`.

        Returns:
            won with token ``old + 1`` (or 1); lost with ``"window"`` outside
            the claim window, ``"held"`` when the record is still
            ``claimed`` with its lease running (its holder, maybe a backup
            that took it over first, may still send it), ``"taken"``
            otherwise (sent, or a manual run).
        Raises:
            BackendUnavailable: no answer.
        """
        with self._write("take over") as conn:
            answer = self._take_over(conn, request)
        if answer.won:
            self._after_writes(
                [(key_of(request.job), request.history_size, request.history_ttl_ms)]
            )
        return answer

    def _take_over(self, conn: Connection, request: ClaimRequest) -> Claim:
        runs = self._tables.runs
        job = key_of(request.job)
        now = self._now(conn)
        if not _in_window(request, now):
            return _lost(request.job, request.slot_ms, "window")
        current = self._current_record(conn, job, request.slot_ms)
        if current is None:
            won = self._insert_if_absent(conn, runs, self._claim_row(request, now, token=1))
            return self._answer(request, won, token=1)
        keep_until_ms = max(request.keep_until_ms, int(current.keep_until_ms))
        scheduled_claim = current.state == State.CLAIMED.value and current.manual_key is None
        if scheduled_claim and (current.lease_until_ms or 0) >= now:
            return _lost(request.job, request.slot_ms, "held")
        if not scheduled_claim or not self._supersede(conn, current, now, keep_until_ms):
            return _lost(request.job, request.slot_ms, "taken")
        row = self._claim_row(request, now, token=int(current.token) + 1)
        row["keep_until_ms"] = keep_until_ms
        conn.execute(sa.insert(runs), row)
        return self._answer(request, True, token=row["token"])

    def take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """:meth:`take_over` for many slots in one transaction: one
        ``SELECT`` of the slots' current records (per :data:`INSERT_CHUNK`)
        answers every slot already sent, or with a live lease, at once; only
        the rest (no record, or ``claimed`` with an expired lease) go through
        :meth:`take_over`'s locked read, supersede and insert.

        Returns:
            one :class:`Claim` per request, in request order.
        Raises:
            BackendUnavailable: no answer; treat every request as lost.
        """
        if not requests:
            return []
        answers: list[Claim] = []
        with self._write("take over") as conn:
            now = self._now(conn)
            keys = [(key_of(r.job), r.slot_ms) for r in requests]
            current = self._current_records(conn, keys)
            for request, key in zip(requests, keys, strict=True):
                row = current.get(key)
                if row is None:
                    answers.append(self._take_over(conn, request))
                elif row.state != State.CLAIMED.value or row.manual_key is not None:
                    answers.append(_lost(request.job, request.slot_ms, "taken"))
                elif (row.lease_until_ms or 0) >= now:
                    answers.append(_lost(request.job, request.slot_ms, "held"))
                else:
                    answers.append(self._take_over(conn, request))
        self._after_writes(
            (key_of(r.job), r.history_size, r.history_ttl_ms)
            for r, a in zip(requests, answers, strict=True)
            if a.won
        )
        return answers

    def holding(self, claims: Sequence[Claim], margin_ms: int = 0) -> list[bool]:
        """Whether each claim is still held, from one ``SELECT`` of the
        slots' current records (per :data:`INSERT_CHUNK`) and the database
        clock (see :meth:`Backend.holding`).

        Raises:
            BackendUnavailable: no answer.
        """
        asked = [c for c in claims if c.won and isinstance(c.token, int)]
        if not asked:
            return [False] * len(claims)
        with self._read("read leases") as conn:
            now = self._now(conn)
            current = self._current_records(
                conn, [(key_of(c.job), c.slot_ms) for c in asked], lock=False
            )
        answers = []
        for claim in claims:
            row = current.get((key_of(claim.job), claim.slot_ms))
            answers.append(
                claim.won
                and row is not None
                and int(row.token) == claim.token
                and row.state == State.CLAIMED.value
                and (row.lease_until_ms or 0) > now + margin_ms
            )
        return answers

    def _current_records(
        self, conn: Connection, keys: Sequence[tuple[str, int]], *, lock: bool = False
    ) -> dict[tuple[str, int], Any]:
        """The current (highest-token) record of each ``(job key, slot_ms)``
        that has one, one ``SELECT`` per :data:`INSERT_CHUNK` keys."""
        runs = self._tables.runs
        found: dict[tuple[str, int], Any] = {}
        unique = sorted(set(keys))
        for start in range(0, len(unique), INSERT_CHUNK):
            chunk = unique[start : start + INSERT_CHUNK]
            query = sa.select(runs).where(sa.tuple_(runs.c.job, runs.c.slot_ms).in_(chunk))
            if lock:
                query = query.with_for_update()
            for row in conn.execute(query):
                key = (row.job, int(row.slot_ms))
                if key not in found or int(row.token) > int(found[key].token):
                    found[key] = row
        return found

    def _current_record(self, conn: Connection, job: str, slot_ms: int) -> Any:
        runs = self._tables.runs
        query = (
            sa.select(runs)
            .where(runs.c.job == job, runs.c.slot_ms == slot_ms)
            .order_by(runs.c.token.desc())
            .limit(1)
            .with_for_update()
        )
        return conn.execute(query).first()

    def _supersede(self, conn: Connection, current: Any, now: int, keep_until_ms: int) -> bool:
        """Mark ``current`` superseded, fenced by its token, state and lease;
        whether it changed (one row)."""
        runs = self._tables.runs
        fenced = (
            sa.update(runs)
            .where(
                runs.c.job == current.job,
                runs.c.slot_ms == current.slot_ms,
                runs.c.token == current.token,
                runs.c.state == State.CLAIMED.value,
                runs.c.lease_until_ms < now,
            )
            .values(state=State.SUPERSEDED.value, keep_until_ms=keep_until_ms)
        )
        return conn.execute(fenced).rowcount == 1

    @staticmethod
    def _answer(request: ClaimRequest, won: bool, token: int) -> Claim:
        if won:
            return Claim(request.job, request.slot_ms, won=True, token=token)
        return _lost(request.job, request.slot_ms, "taken")

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back won claims that were not sent, in one transaction.

        A first record (token 1) still ``claimed`` with the claim's token is
        deleted, so any instance can claim the slot at once. A record that
        came from a takeover (token above 1) cannot be deleted without
        reopening its superseded predecessor's key, so its lease is ended
        instead (``lease_until_ms = 0``): :meth:`take_over` then wins it at
        once. Records already sent, or with another token, are left alone.

        Raises:
            BackendUnavailable: no answer.
        """
        mine = [c for c in claims if c.won and isinstance(c.token, int)]
        if not mine:
            return
        runs = self._tables.runs
        with self._write("release") as conn:
            for claim in mine:
                fenced = (
                    runs.c.job == key_of(claim.job),
                    runs.c.slot_ms == claim.slot_ms,
                    runs.c.token == claim.token,
                    runs.c.state == State.CLAIMED.value,
                )
                if claim.token == 1:
                    conn.execute(sa.delete(runs).where(*fenced))
                else:
                    conn.execute(sa.update(runs).where(*fenced).values(lease_until_ms=0))
        logger.debug("anarchon: released %d claim(s)", len(mine))

    # -- states --------------------------------------------------------------

    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a won claim's record forward to ``state`` (``sent``,
        ``running``, ``succeeded``, ``failed`` or ``lost``) with one fenced
        ``UPDATE .. WHERE job, slot_ms, token = claim.token AND state IN
        (<states it may move from>)``.

        States only move forward: ``claimed`` < ``sent`` < ``running`` <
        ``succeeded`` / ``failed`` / ``lost``. So ``mark(claim, RUNNING)``
        is the worker's start gate: the first call moves the run and returns
        True, a duplicate delivery's call finds it ``running`` and returns
        False (concurrent calls queue on the row lock and re-check the
        state). A ``sent`` that arrives after the worker moved the run on
        (a late ``sent``) fills in ``sent_at_ms`` and ``task_id``, keeps the
        state, and returns True. The state's timestamp (``sent_at_ms``,
        ``started_at_ms`` or ``finished_at_ms``) becomes the database's now;
        ``task_id`` / ``error`` are written when given.

        Returns:
            False when no current record carries ``claim.token`` (taken over,
            released, trimmed, or the claim was lost), or the move is not
            forward (``claimed`` never is); nothing is written then.
        Raises:
            ValueError: ``state`` is ``missed``, ``skipped`` or
                ``superseded``, which :meth:`record_if_absent` and
                :meth:`take_over` write, never :meth:`mark`.
            BackendUnavailable: no answer.
        """
        state = State(state)
        if state in (State.MISSED, State.SKIPPED, State.SUPERSEDED):
            raise ValueError(f"mark() cannot record {state.value!r}; see record_if_absent()")
        if state is State.CLAIMED or not claim.won or not isinstance(claim.token, int):
            return False
        runs = self._tables.runs
        fenced = (
            runs.c.job == key_of(claim.job),
            runs.c.slot_ms == claim.slot_ms,
            runs.c.token == claim.token,
            runs.c.state.in_([s.value for s in _MOVES_FROM[state]]),
        )
        with self._write("mark") as conn:
            update = sa.update(runs).where(*fenced).values(self._mark_values(state, task_id, error))
            changed = conn.execute(update).rowcount
            if changed == 0 and self.kind == "mysql":
                # MySQL counts changed rows: a late 'sent' repeated with the
                # same values in the same millisecond changes none.
                changed = len(conn.execute(sa.select(runs.c.token).where(*fenced)).all())
        return changed == 1

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many claims in one transaction: one ``SELECT ..
        FOR UPDATE`` of the records ``(job, slot_ms, token)`` of the claims
        (per :data:`INSERT_CHUNK`) decides which may move (token present,
        state one it may move from), then one fenced ``UPDATE`` sent with
        ``executemany`` moves them (the rows are locked, so none changes in
        between; SQLite's write transaction is exclusive).

        Returns:
            one answer per claim, in order (see :meth:`mark`).
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``; ``state``
                is ``missed``, ``skipped`` or ``superseded``.
            BackendUnavailable: no answer; nothing was written.
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        state = State(state)
        if state in (State.MISSED, State.SKIPPED, State.SUPERSEDED):
            raise ValueError(f"mark() cannot record {state.value!r}; see record_if_absent()")
        asked = {
            (key_of(c.job), c.slot_ms, c.token): i
            for i, c in enumerate(claims)
            if state is not State.CLAIMED and c.won and isinstance(c.token, int)
        }
        answers = [False] * len(claims)
        if not asked:
            return answers
        runs = self._tables.runs
        movable = {s.value for s in _MOVES_FROM[state]}
        with self._write("mark") as conn:
            keys = sorted(asked)
            rows: list[Any] = []
            for start in range(0, len(keys), INSERT_CHUNK):
                chunk = keys[start : start + INSERT_CHUNK]
                where = sa.tuple_(runs.c.job, runs.c.slot_ms, runs.c.token).in_(chunk)
                query = sa.select(runs.c.job, runs.c.slot_ms, runs.c.token, runs.c.state)
                rows.extend(conn.execute(query.where(where).with_for_update()))
            moving = sorted(
                (row.job, int(row.slot_ms), int(row.token)) for row in rows if row.state in movable
            )
            if not moving:
                return answers
            values = self._mark_values(state, None, None)
            values["task_id"] = sa.func.coalesce(
                sa.bindparam("m_task", type_=sa.Text), runs.c.task_id
            )
            update = (
                sa.update(runs)
                .where(
                    runs.c.job == sa.bindparam("m_job"),
                    runs.c.slot_ms == sa.bindparam("m_slot"),
                    runs.c.token == sa.bindparam("m_token"),
                    sa.or_(*(runs.c.state == value for value in sorted(movable))),
                )
                .values(values)
            )
            params = []
            for key in moving:
                i = asked[key]
                task_id = ids[i]
                params.append(
                    {
                        "m_job": key[0],
                        "m_slot": key[1],
                        "m_token": key[2],
                        "m_task": None if task_id is None else _clean(task_id),
                    }
                )
                answers[i] = True
            conn.execute(update, params)
        return answers

    def _mark_values(self, state: State, task_id: str | None, error: str | None) -> dict[str, Any]:
        runs = self._tables.runs
        values: dict[str, Any] = {_STAMP[state]: self._now_expr()}
        if state is State.SENT:  # a late 'sent' keeps the state it finds
            values["state"] = sa.case(
                (runs.c.state == State.CLAIMED.value, State.SENT.value), else_=runs.c.state
            )
        else:
            values["state"] = state.value
        if task_id is not None:
            values["task_id"] = _clean(task_id)
        if error is not None:
            values["error"] = _clean(error)
        return values

    def extend(self, claim: Claim, lease_ms: int, *, restart: bool = False) -> bool:
        """Extend a running run's lease (the worker's heartbeat) with one
        fenced ``UPDATE .. SET lease_until_ms = <now> + lease_ms WHERE job,
        slot_ms, token = claim.token AND state = 'running'``; ``lease_ms`` in
        milliseconds, ``<now>`` the database clock.

        ``restart=True`` adds ``AND lease_until_ms < <now>`` and sets
        ``started_at_ms = <now>``: an ``acks_late`` redelivery takes over a
        run whose worker stopped heartbeating (see :meth:`Backend.extend`).
        Concurrent calls queue on the row lock; one restart wins.

        Returns:
            True when one row was written, else False.
        Raises:
            BackendUnavailable: no answer.
        """
        if not claim.won or not isinstance(claim.token, int):
            return False
        runs = self._tables.runs
        now = self._now_expr()
        fenced = [
            runs.c.job == key_of(claim.job),
            runs.c.slot_ms == claim.slot_ms,
            runs.c.token == claim.token,
            runs.c.state == State.RUNNING.value,
        ]
        values: dict[str, Any] = {"lease_until_ms": now + int(lease_ms)}
        if restart:
            fenced.append(sa.or_(runs.c.lease_until_ms.is_(None), runs.c.lease_until_ms < now))
            values["started_at_ms"] = now
        with self._write("extend") as conn:
            changed = conn.execute(sa.update(runs).where(*fenced).values(values)).rowcount
            if changed == 0 and self.kind == "mysql" and not restart:
                # MySQL counts changed rows: a heartbeat repeated in the same
                # millisecond changes none.
                changed = len(conn.execute(sa.select(runs.c.token).where(*fenced)).all())
        return changed == 1

    def record_if_absent(
        self,
        job: str,
        slot_ms: int,
        state: State,
        *,
        error: str | None = None,
        history_size: int = DEFAULT_HISTORY_SIZE,
        history_ttl_ms: int = 7 * 24 * 3600 * 1000,
        keep_until_ms: int = 0,
    ) -> bool:
        """Record ``state`` (``missed`` or ``skipped``) as the slot's first
        record with the claim's conditional insert, closing the slot.

        Returns:
            True when written; False when the slot already had a record.
        Raises:
            BackendUnavailable: no answer.
        """
        record = AbsentRecord(
            job, slot_ms, State(state), error, history_size, history_ttl_ms, keep_until_ms
        )
        with self._write("record") as conn:
            written = self._insert_if_absent(conn, self._tables.runs, self._absent_row(record))
        if written:
            self._after_writes([(key_of(job), history_size, history_ttl_ms)])
        return written

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """:meth:`record_if_absent` for many slots in one transaction: the
        claim's multi-row conditional insert (rows in key order; a slot
        twice in ``records`` is written once, its first answer True).

        Returns:
            one answer per record, in order.
        Raises:
            BackendUnavailable: no answer; nothing was written.
        """
        if not records:
            return []
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        for r in records:
            rows.setdefault((key_of(r.job), r.slot_ms), self._absent_row(r))
        with self._write("record") as conn:
            written = self._insert_claims(conn, [rows[slot] for slot in sorted(rows)])
        answers = []
        for r in records:
            slot = (key_of(r.job), r.slot_ms)
            answers.append(slot in written)
            written.discard(slot)
        self._after_writes(
            (key_of(r.job), r.history_size, r.history_ttl_ms)
            for r, answer in zip(records, answers, strict=True)
            if answer
        )
        return answers

    def _absent_row(self, r: AbsentRecord) -> dict[str, Any]:
        return {
            "job": key_of(r.job),
            "slot_ms": r.slot_ms,
            "token": 1,
            "state": State(r.state).value,
            "owner": self.instance,
            "keep_until_ms": r.keep_until_ms,
            "error": None if r.error is None else _clean(r.error),
        }

    # -- run_now -------------------------------------------------------------

    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run (``run_now``) of ``job`` under ``key``.

        One transaction: the conditional insert of ``(job, key)`` into
        ``<prefix>manual`` (the same statement as a claim's); when that key
        exists, the call is lost. Otherwise the run record (state
        ``claimed``, token 1, ``manual_key = key``, lease until
        ``keep_until_ms``) goes to the first free millisecond from the
        database's now, skipping whole seconds, where nearly every scheduled
        slot falls (cron, whole-second intervals), so a manual run
        practically never takes a scheduled slot. The key row comes first:
        racers for one key then queue on that one row, and never hold a run
        row while waiting (MariaDB found deadlocks in the other order). The
        key is kept while its run record is, and at least until
        ``keep_until_ms``.

        Returns:
            won with the run's ``slot_ms`` and token 1; or lost (``"taken"``)
            with the slot of the run that used the key.
        Raises:
            BackendUnavailable: no answer (or no free millisecond in
                :data:`MANUAL_SLOT_TRIES`).
        """
        manual = self._tables.manual
        this_key = (manual.c.job == key_of(job), manual.c.manual_key == key_of(key))
        with self._write("claim a manual run") as conn:
            now = self._now(conn)
            guard = {
                "job": key_of(job),
                "manual_key": key_of(key),
                "slot_ms": now,
                "keep_until_ms": keep_until_ms,
            }
            if not self._insert_if_absent(conn, manual, guard):
                used = conn.execute(sa.select(manual.c.slot_ms).where(*this_key)).scalar()
                return _lost(job, now if used is None else int(used), "taken")
            slot = self._insert_manual_run(conn, job, key, now, keep_until_ms)
            if slot != now:
                conn.execute(sa.update(manual).where(*this_key).values(slot_ms=slot))
        logger.debug("anarchon: manual run of %r under key %r claimed", job, key)
        return Claim(job, slot, won=True, token=1)

    def _insert_manual_run(
        self, conn: Connection, job: str, key: str, now: int, keep_until_ms: int
    ) -> int:
        row: dict[str, Any] = {
            "job": key_of(job),
            "token": 1,
            "state": State.CLAIMED.value,
            "owner": self.instance,
            "lease_until_ms": keep_until_ms,
            "keep_until_ms": keep_until_ms,
            "claimed_at_ms": now,
            "manual_key": _clean(key),
        }
        slot = now
        for _ in range(MANUAL_SLOT_TRIES):
            if slot % 1000 == 0:
                slot += 1
            if self._insert_if_absent(conn, self._tables.runs, {**row, "slot_ms": slot}):
                return slot
            slot += 1
        raise BackendUnavailable(
            f"{self.describe()}: no free millisecond for a manual run of {job!r} "
            f"within {MANUAL_SLOT_TRIES} ms of now"
        )

    # -- history -------------------------------------------------------------

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's records, newest slot first (for one slot, the current
        record before superseded ones), at most ``limit``: ``SELECT .. WHERE
        job = :job ORDER BY slot_ms DESC, token DESC LIMIT :limit``.

        A row whose state this version does not know (written by another
        program, or by a newer celery-anarchon) is left out with a warning;
        its slot stays taken, since claims check the key, not the state.

        Raises:
            BackendUnavailable: no answer.
        """
        if limit is not None and limit <= 0:
            return []
        runs = self._tables.runs
        query = (
            sa.select(runs)
            .where(runs.c.job == key_of(job))
            .order_by(runs.c.slot_ms.desc(), runs.c.token.desc())
            .limit(limit)
        )
        with self._read("read history") as conn:
            rows = list(conn.execute(query))
        return [record for record in (_record_or_none(job, row) for row in rows) if record]

    # -- instance registry ---------------------------------------------------

    def register(self, info: InstanceInfo, ttl_ms: int) -> bool:
        """Add or refresh ``info`` (an upsert, without its jobs); its
        ``heartbeat_ms`` becomes the database's now and it drops out
        ``ttl_ms`` milliseconds later unless refreshed. Instances already
        expired are deleted, with their definitions. ``info.jobs``, when not
        empty, is upserted into ``<prefix>schedules`` (see
        :meth:`Backend.register`).

        Returns:
            True when ``<prefix>schedules`` holds this instance's
            definitions for ``info.fingerprint``.
        Raises:
            BackendUnavailable: no answer.
        """
        table, schedules = self._tables.instances, self._tables.schedules
        fields = asdict(info)
        jobs = fields.pop("jobs")
        instance = key_of(info.instance)
        with self._write("register") as conn:
            now = self._now(conn)
            # Expired entries go first, with their definitions: an instance
            # back after its entry expired is told to send them again.
            conn.execute(sa.delete(table).where(table.c.expires_ms <= now))
            live = sa.select(table.c.instance).where(table.c.instance == schedules.c.instance)
            conn.execute(sa.delete(schedules).where(sa.not_(live.exists())))
            row = {
                "instance": instance,
                "info": json.dumps(fields),
                "heartbeat_ms": now,
                "expires_ms": now + ttl_ms,
            }
            conn.execute(self._upsert(table, row))
            if jobs:
                conn.execute(
                    self._upsert(
                        schedules,
                        {
                            "instance": instance,
                            "fingerprint": info.fingerprint,
                            "jobs": json.dumps(jobs),
                        },
                    )
                )
                return True
            stored = conn.execute(
                sa.select(schedules.c.fingerprint).where(schedules.c.instance == instance)
            ).scalar()
        return stored == info.fingerprint

    def unregister(self, instance: str) -> None:
        """Remove ``instance`` from the registry.

        Raises:
            BackendUnavailable: no answer.
        """
        table, schedules = self._tables.instances, self._tables.schedules
        with self._write("unregister") as conn:
            conn.execute(sa.delete(table).where(table.c.instance == key_of(instance)))
            conn.execute(sa.delete(schedules).where(schedules.c.instance == key_of(instance)))

    def instances(self) -> list[InstanceInfo]:
        """Instances whose registration has not expired by the database's
        clock, oldest start first.

        Raises:
            BackendUnavailable: no answer.
        """
        table = self._tables.instances
        with self._read("read instances") as conn:
            now = self._now(conn)
            rows = conn.execute(
                sa.select(table.c.info, table.c.heartbeat_ms).where(table.c.expires_ms > now)
            ).all()
        found = [
            InstanceInfo.from_dict({**json.loads(info), "heartbeat_ms": beat})
            for info, beat in rows
        ]
        return sorted(found, key=lambda i: (i.started_ms, i.instance))

    def definitions(self, instance: str) -> dict[str, str]:
        """The definitions ``instance`` stored with :meth:`register` (its
        ``<prefix>schedules`` row), empty when none.

        Raises:
            BackendUnavailable: no answer.
        """
        schedules = self._tables.schedules
        with self._read("read definitions") as conn:
            raw = conn.execute(
                sa.select(schedules.c.jobs).where(schedules.c.instance == key_of(instance))
            ).scalar()
        return dict(json.loads(raw)) if raw else {}

    def last_slots(self, jobs: Sequence[str]) -> dict[str, int]:
        """``job -> newest scheduled slot with a record`` for each of
        ``jobs`` that has one: ``SELECT job, max(slot_ms) .. WHERE job IN
        (..) AND manual_key IS NULL GROUP BY job``, one query per
        :data:`INSERT_CHUNK` jobs (see :meth:`Backend.last_slots`).

        Raises:
            BackendUnavailable: no answer.
        """
        runs = self._tables.runs
        names = {key_of(job): job for job in jobs}
        keys = list(names)
        found: dict[str, int] = {}
        with self._read("read last slots") as conn:
            for start in range(0, len(keys), INSERT_CHUNK):
                query = (
                    sa.select(runs.c.job, sa.func.max(runs.c.slot_ms))
                    .where(
                        runs.c.job.in_(keys[start : start + INSERT_CHUNK]),
                        runs.c.manual_key.is_(None),
                    )
                    .group_by(runs.c.job)
                )
                for job, slot in conn.execute(query):
                    if job in names and slot is not None:
                        found[names[job]] = int(slot)
        return found

    # -- trimming ------------------------------------------------------------

    def _after_writes(self, writes: Iterable[tuple[str, int, int]]) -> None:
        """Count writes per job key and trim the histories now due (see the
        class docstring); ``writes`` holds ``(job key, history_size,
        history_ttl_ms)``. A job is first trimmed at a write between its
        ``every``-th and ``2 * every - 1``-th (at an offset of its own),
        then at every ``every``-th: jobs written together (a burst) are
        trimmed in different rounds, and a new job's first writes never are.
        Once :meth:`housekeep` has been called, due trims wait for its next
        call: at most :data:`MAX_DEFERRED_TRIMS` jobs for at most
        :data:`MAX_TRIM_WAIT_S` seconds; a write that finds more, or older,
        trims those itself. A failed trim is logged, never raised."""
        due: dict[str, tuple[int, int]] = {}
        for job, size, ttl_ms in writes:
            every = _trim_every(size)
            count = self._writes.get(job, 0) + 1
            self._writes[job] = count
            offset = int.from_bytes(hashlib.blake2b(job.encode(), digest_size=4).digest())
            if count >= every and (count + offset) % every == 0:
                due[job] = (size, ttl_ms)
        if not due:
            return
        if not self._housekept:
            self._trim_now(due)
            return
        now = time.monotonic()
        for job, (size, ttl_ms) in due.items():
            waiting = self._trims_due.get(job)
            self._trims_due[job] = (size, ttl_ms, waiting[2] if waiting else now)
        # Oldest first (a job keeps its place while it waits): the overdue
        # and the excess are at the head.
        overdue = itertools.takewhile(
            lambda job: now - self._trims_due[job][2] > MAX_TRIM_WAIT_S, self._trims_due
        )
        count = max(len(list(overdue)), len(self._trims_due) - MAX_DEFERRED_TRIMS)
        if count > 0:
            oldest = list(itertools.islice(self._trims_due, count))
            self._trim_now({job: self._trims_due.pop(job)[:2] for job in oldest})

    def housekeep(self, budget_s: float = 0.5) -> None:
        """Run the history trims that writes left due, for about
        ``budget_s`` seconds at most (one transaction per
        :data:`TRIM_CHUNK` jobs); the rest wait for the next call. From the
        first call on, writes leave their trims to this method instead of
        trimming in their own call (see :meth:`Backend.housekeep`). Never
        raises: a failed trim is logged and kept for the next call."""
        self._housekept = True
        deadline = time.monotonic() + budget_s
        while self._trims_due and time.monotonic() < deadline:
            jobs = list(itertools.islice(self._trims_due, TRIM_CHUNK))
            chunk = {job: self._trims_due.pop(job) for job in jobs}
            if not self._trim_now({job: waiting[:2] for job, waiting in chunk.items()}):
                self._trims_due.update(chunk)
                return

    def _trim_now(self, due: dict[str, tuple[int, int]]) -> bool:
        """Trim the histories of ``due`` (``job key -> (history_size,
        history_ttl_ms)``) in one transaction; False (logged) when it failed."""
        try:
            with self._write("trim history") as conn:
                now = self._now(conn)
                for job, (size, ttl_ms) in sorted(due.items()):
                    self._trim(conn, job, size, ttl_ms, now)
        except BackendUnavailable as exc:
            logger.warning("anarchon: history trim failed, retried later: %s", exc)
            return False
        return True

    def _trim(self, conn: Connection, job: str, size: int, ttl_ms: int, now: int) -> None:
        """Delete ``job``'s records with a slot before ``now - ttl_ms`` or
        beyond the newest ``size``, unless ``keep_until_ms`` is after ``now``;
        then the manual keys whose run is gone and whose keep-until passed."""
        runs, manual = self._tables.runs, self._tables.manual
        cut = conn.execute(
            sa.select(runs.c.slot_ms)
            .where(runs.c.job == job)
            .order_by(runs.c.slot_ms.desc(), runs.c.token.desc())
            .offset(max(size, 0))
            .limit(1)
        ).scalar()
        old = runs.c.slot_ms < now - ttl_ms
        if cut is not None:
            old = sa.or_(old, runs.c.slot_ms <= cut)
        conn.execute(sa.delete(runs).where(runs.c.job == job, runs.c.keep_until_ms <= now, old))
        has_run = (
            sa.select(runs.c.token)
            .where(runs.c.job == manual.c.job, runs.c.slot_ms == manual.c.slot_ms)
            .exists()
        )
        conn.execute(
            sa.delete(manual).where(
                manual.c.job == job, manual.c.keep_until_ms <= now, sa.not_(has_run)
            )
        )

    # -- SQL helpers ---------------------------------------------------------

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

    # -- connections and errors ----------------------------------------------

    def _ensure_open(self) -> Engine:
        if self._pid != os.getpid():
            self._forget_parent_connections()
        if not self._ready:
            self.open()
        assert self._engine is not None
        return self._engine

    def _forget_parent_connections(self) -> None:
        """In a forked child: give our engine a fresh pool, leaving the
        parent's connections (shared sockets) alone, as SQLAlchemy advises
        for multiprocessing (``Engine.dispose(close=False)``)."""
        if self._owns_engine and self._engine is not None:
            self._engine.dispose(close=False)
        self._pid = os.getpid()

    @contextmanager
    def _unavailable(self, what: str) -> Iterator[None]:
        """Raise driver and pool errors as BackendUnavailable."""
        try:
            yield
        except _DRIVER_ERRORS as exc:
            raise BackendUnavailable(f"{self.describe()}: {what} failed: {_reason(exc)}") from exc

    @contextmanager
    def _write(self, what: str) -> Iterator[Connection]:
        """A connection in a write transaction, committed on success."""
        engine = self._ensure_open()
        with self._unavailable(what), engine.begin() as conn:
            yield conn

    @contextmanager
    def _read(self, what: str) -> Iterator[Connection]:
        """A connection for reads (SQLite: a deferred transaction)."""
        engine = self._ensure_open()
        with self._unavailable(what), engine.connect() as conn:
            yield conn.execution_options(anarchon_read=True)

    def _check_sqlite_dir(self) -> None:
        if self.kind != "sqlite":
            return
        folder = os.path.dirname(os.path.abspath(self._url.database or ""))
        if not os.path.isdir(folder):
            raise ConfigurationError(
                f"anarchon_backend: the directory of the SQLite file {self._url.database!r} "
                f"does not exist; create {folder!r} or point anarchon_backend elsewhere."
            )

    def _create_engine(self) -> Engine:
        """An engine of our own: short timeouts, a ping before using a
        connection that was idle (:func:`_check_on_checkout`), per-dialect
        setup."""
        common: dict[str, Any] = {"pool_timeout": self.connect_timeout}
        if self.kind == "sqlite":
            engine = sa.create_engine(
                self._url, connect_args={"timeout": self.statement_timeout}, **common
            )
            sa.event.listen(engine, "connect", _sqlite_setup(self.statement_timeout))
            sa.event.listen(engine, "begin", _sqlite_on_begin)
            return engine
        if self.kind == "postgresql":
            engine = sa.create_engine(self._url, connect_args=self._postgres_args(), **common)
            _check_on_checkout(engine)
            return engine
        engine = sa.create_engine(
            self._url,
            isolation_level="READ COMMITTED",
            connect_args=self._mysql_args(),
            **common,
        )
        sa.event.listen(engine, "do_connect", _without_found_rows)
        _check_on_checkout(engine)
        return engine

    def _postgres_args(self) -> dict[str, Any]:
        timeout_ms = int(self.statement_timeout * 1000)
        options = str(self._url.query.get("options", ""))
        return {
            "connect_timeout": max(2, math.ceil(self.connect_timeout)),
            "options": f"{options} -c statement_timeout={timeout_ms}".strip(),
            "tcp_user_timeout": timeout_ms,
            "application_name": str(self._url.query.get("application_name", "celery-anarchon")),
        }

    def _mysql_args(self) -> dict[str, Any]:
        lock_wait = max(1, math.floor(self.statement_timeout))
        return {
            "connect_timeout": self.connect_timeout,
            "read_timeout": self.statement_timeout,
            "write_timeout": self.statement_timeout,
            "charset": str(self._url.query.get("charset", "utf8mb4")),
            "init_command": f"SET SESSION innodb_lock_wait_timeout = {lock_wait}",
        }

    def _check_found_rows(self, engine: Engine) -> None:
        """Refuse a MySQL connection that counts found rather than changed
        rows: a lost claim's no-op update would then read as won."""
        if self.kind != "mysql":
            return
        with engine.connect() as conn:
            flags = getattr(conn.connection.dbapi_connection, "client_flag", 0)
        if flags & CLIENT_FOUND_ROWS:
            raise ConfigurationError(
                "anarchon_backend: the MySQL Engine given reports found rows "
                "(CLIENT_FOUND_ROWS, set by SQLAlchemy), which makes a lost claim look won. "
                "Pass the database URL instead, or strip the flag in a 'do_connect' event "
                "listener: cparams['client_flag'] &= ~2."
            )

    def _create_tables(self, engine: Engine) -> None:
        for table in self._tables.metadata.sorted_tables:
            try:
                with engine.begin() as conn:
                    conn.execute(CreateTable(table, if_not_exists=True))
            except (sa.exc.IntegrityError, sa.exc.ProgrammingError):
                # PostgreSQL: another process created it during our CREATE.
                with engine.connect() as conn:
                    if not sa.inspect(conn).has_table(table.name):
                        raise
                logger.debug("anarchon: table %s was created concurrently", table.name)

    def _foreign_tables(self, engine: Engine) -> list[str]:
        """``"<table> lacks <columns>"`` for each table of our names that
        lacks columns of ours (another program's table, made before ours)."""
        found = []
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            for table in self._tables.metadata.sorted_tables:
                present = {c["name"].lower() for c in inspector.get_columns(table.name)}
                missing = [c.name for c in table.columns if c.name.lower() not in present]
                if missing:
                    found.append(f"table {table.name} lacks column(s) {', '.join(missing)}")
        return found

    def _schema_version(self, engine: Engine) -> int:
        meta = self._tables.meta
        row = {"name": "schema_version", "value": str(SCHEMA_VERSION)}
        with engine.begin() as conn:
            if self._insert_if_absent(conn, meta, row):
                logger.info("anarchon: created tables %s* in %s", self.prefix, self.describe())
            query = sa.select(meta.c.value).where(meta.c.name == "schema_version")
            return int(conn.execute(query).scalar_one())


def _check_on_checkout(engine: Engine) -> None:
    """Check a pooled connection before use, as SQLAlchemy's
    ``pool_pre_ping`` does, but with a round trip only after an idle spell:
    a connection back in the pool for :data:`PING_AFTER_IDLE_S` or longer is
    pinged; one used more recently only has its socket polled (no round
    trip) for a close by the server. Either finding a dead connection raises
    ``DisconnectionError``, on which the pool replaces it (SQLAlchemy's
    "pessimistic disconnect handling")."""
    dialect = engine.dialect

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info["anarchon_idle_since"] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("anarchon_idle_since")
        if since is None:  # just connected
            return
        try:
            if time.monotonic() - since >= PING_AFTER_IDLE_S or _closed_by_server(dbapi_connection):
                dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise sa.exc.DisconnectionError(f"connection found dead before use: {exc}") from exc

    sa.event.listen(engine, "checkin", checkin)
    sa.event.listen(engine, "checkout", checkout)


def _closed_by_server(dbapi_connection: Any) -> bool:
    """Whether an idle connection's socket is readable (the server closed
    it, or sent something unasked): a ``select`` with no wait, no round
    trip. True when the socket cannot be found (then the caller pings)."""
    try:
        if hasattr(dbapi_connection, "pgconn"):  # psycopg 3
            fd = dbapi_connection.pgconn.socket
        else:  # PyMySQL
            sock = getattr(dbapi_connection, "_sock", None)
            if sock is None:
                return True
            fd = sock.fileno()
        readable, _, _ = select.select([fd], [], [], 0)
    except Exception:  # a closed connection has no socket left
        return True
    return bool(readable)


def _parse_url(url: str) -> URL:
    """Parse ``url`` and map its driver name (see :data:`DRIVERS`).

    Raises:
        ConfigurationError: unparsable, unknown driver, or in-memory SQLite.
    """
    try:
        parsed = sa.engine.make_url(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(
            f"anarchon_backend: cannot parse {sanitize_url(url)!r} as an SQL URL: {exc}"
        ) from exc
    driver = DRIVERS.get(parsed.drivername.lower())
    if driver is None:
        raise ConfigurationError(
            f"anarchon_backend: unsupported SQL URL scheme {parsed.drivername!r}; use "
            f"one of {', '.join(sorted(DRIVERS))}."
        )
    parsed = parsed.set(drivername=driver)
    if driver == "sqlite" and _in_memory(parsed):
        raise ConfigurationError(
            f"anarchon_backend: {sanitize_url(url)!r} is an in-memory SQLite database, "
            "which other processes cannot see, so it cannot deduplicate claims; use a "
            "file, e.g. 'sqlite:////var/lib/celery/anarchon.db'."
        )
    return parsed


def _in_memory(url: URL) -> bool:
    database = url.database or ""
    return database in ("", ":memory:") or url.query.get("mode") == "memory"


def _sqlite_setup(busy_timeout: float) -> Callable[[Any, Any], None]:
    """A ``connect`` listener: let SQLAlchemy's ``begin`` event issue BEGIN,
    and turn on WAL so readers never block the writer.

    WAL is kept in the file, so only the first connection to a new file
    switches; switching needs the file to itself and fails at once with
    "database is locked" (no busy wait) while another process is in it, so
    it is retried for up to ``busy_timeout`` seconds.
    """

    def setup(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                dbapi_connection.execute("PRAGMA journal_mode=WAL").close()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    return setup


def _sqlite_on_begin(conn: Connection) -> None:
    """``BEGIN IMMEDIATE`` for writes: the write lock is taken (waiting up to
    the busy timeout) before the first read, so a transaction never fails
    upgrading a stale snapshot; plain ``BEGIN`` for reads."""
    read = conn.get_execution_options().get("anarchon_read", False)
    conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")


def _without_found_rows(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    """Connect without ``CLIENT_FOUND_ROWS``, so affected rows count changed
    rows: 1 for an inserted claim, 0 for a duplicate's no-op update."""
    cparams["client_flag"] = int(cparams.get("client_flag", 0)) & ~CLIENT_FOUND_ROWS


def _reason(exc: Exception) -> str:
    """The driver's own message, first line, with its class."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines() or [""]
    return f"{type(orig).__name__}: {lines[0]}"


def _record_or_none(job: str, row: Any) -> RunRecord | None:
    """The history record of ``row``, or None (logged) when its state is unknown."""
    try:
        return _record(job, row)
    except ValueError:
        logger.warning(
            "anarchon: history of %s: row for slot %s has state %r, unknown to this "
            "version; left out (the slot stays taken)",
            job,
            row.slot_ms,
            row.state,
        )
        return None


def _record(job: str, row: Any) -> RunRecord:
    return RunRecord(
        job=job,
        slot_ms=int(row.slot_ms),
        state=State(row.state),
        instance=row.owner,
        token=int(row.token),
        claimed_at_ms=row.claimed_at_ms,
        sent_at_ms=row.sent_at_ms,
        started_at_ms=row.started_at_ms,
        finished_at_ms=row.finished_at_ms,
        task_id=row.task_id,
        error=row.error,
        manual_key=row.manual_key,
        lease_until_ms=row.lease_until_ms,
    )
