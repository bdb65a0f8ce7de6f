"""Connecting the SQL backend: URL parsing, engines per dialect, pool checks,
table creation, and driver errors as BackendUnavailable.
"""

from __future__ import annotations

import logging
import math
import os
import re
import select
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.schema import CreateTable

from ...exceptions import BackendUnavailable, ConfigurationError
from ...times import option_seconds
from .. import SCHEMES, sanitize_url
from .dialects import SQLDialects
from .naming import SCHEMA_VERSION

logger = logging.getLogger(__name__)


#: URL scheme we accept -> the SQLAlchemy driver name we use (from the one
#: table of schemes, :data:`celery_anarchon.backends.SCHEMES`).
DRIVERS = {name: s.sqlalchemy for name, s in SCHEMES.items() if s.sqlalchemy is not None}


#: A pooled connection idle for longer than this is pinged before use,
#: seconds; one used more recently only has its socket checked for a close
#: by the server (no round trip).
PING_AFTER_IDLE_S = 1.0


#: ``CLIENT_FOUND_ROWS``, bit 2 of the MySQL client capability flags
#: (https://dev.mysql.com/doc/dev/mysql-server/latest/group__group__cs__capabilities__flags.html).
CLIENT_FOUND_ROWS = 2


_DRIVER_ERRORS = (sa.exc.DBAPIError, sa.exc.TimeoutError, sa.exc.DisconnectionError)


#: A call to PostgreSQL or MySQL gives up this long after ``statement_timeout``
#: (seconds) when the server has not answered (:class:`_Watchdog`).
WATCHDOG_SLACK_S = 1.0


def _socket_fd(dbapi_connection: Any) -> int | None:
    """The file descriptor of a driver connection's socket (psycopg 3 or
    PyMySQL), or None when it has none (closed)."""
    try:
        if hasattr(dbapi_connection, "pgconn"):  # psycopg 3
            fd = int(dbapi_connection.pgconn.socket)
        else:  # PyMySQL
            sock = getattr(dbapi_connection, "_sock", None)
            fd = -1 if sock is None else sock.fileno()
    except Exception:
        return None
    return fd if fd >= 0 else None


class _Watchdog:
    """The client-side bound of every call to PostgreSQL or MySQL.

    A server-side ``statement_timeout`` cannot end a call whose query never
    reached the server (a hung server, a pooler whose database went away, a
    link that swallows packets), and TCP's own timers never fire while
    something on the way acknowledges the data. So each call (the checkout
    with its ping, every statement, the commit) runs under :meth:`bound`:
    ``limit_s`` seconds after it began, a timer shuts the sockets of the
    connections it checked out down. The driver's wait then ends at once
    with a connection error, which SQLAlchemy takes for a disconnect (the
    connection is dropped from the pool) and the backend raises as
    BackendUnavailable.
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._local = threading.local()

    def listen(self, engine: Engine) -> None:
        """Track the connections a bounded call checks out (register
        before any other ``checkout`` listener: the ping runs in those)."""
        sa.event.listen(engine, "checkout", self._on_checkout)

    def _on_checkout(self, dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        armed = getattr(self._local, "armed", None)
        if armed is not None:
            armed.append(dbapi_connection)

    @contextmanager
    def bound(self) -> Iterator[list[Any]]:
        """Run the block under the bound (a nested block shares its outer
        one); yields the list of connections checked out meanwhile, whose
        first item after a timeout is the string ``"timed out"``."""
        if getattr(self._local, "armed", None) is not None:
            yield self._local.armed
            return
        armed: list[Any] = []
        self._local.armed = armed
        timer = threading.Timer(self.limit_s, self._fire, (armed,))
        timer.daemon = True
        timer.start()
        try:
            yield armed
        finally:
            timer.cancel()
            self._local.armed = None

    @staticmethod
    def _fire(armed: list[Any]) -> None:
        conns = list(armed)
        armed.insert(0, "timed out")
        for conn in conns:
            fd = _socket_fd(conn)
            if fd is None:
                continue
            with suppress(OSError):
                sock = socket.socket(fileno=os.dup(fd))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.close()


def _seconds(name: str, value: Any) -> float:
    """A positive duration option in seconds, at most an hour
    (:func:`~celery_anarchon.times.option_seconds`)."""
    return option_seconds(name, value, most=3600)


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


#: What PostgreSQL says when it refuses a login (libpq's connection errors
#: carry no SQLSTATE, so the server's text is matched): a wrong password,
#: a role that does not exist, no ``pg_hba.conf`` entry for it.
_PG_AUTH_REFUSED = re.compile(
    r"password authentication failed|role \"[^\"]*\" does not exist|no pg_hba\.conf entry"
    r"|authentication failed for user"
)

#: MySQL/MariaDB errors that refuse a login: ER_ACCESS_DENIED_ERROR (1045),
#: ER_DBACCESS_DENIED_ERROR (1044), ER_ACCESS_DENIED_NO_PASSWORD_ERROR (1698:
#: MariaDB's answer to some unknown users, seen in one of several runs).
_MYSQL_AUTH_REFUSED = frozenset({1044, 1045, 1698})


def _auth_refused(exc: BaseException) -> bool:
    """True when the database refused the credentials (a driver error
    wrapped by SQLAlchemy, or the driver's own): PostgreSQL's messages
    above, or a MySQL error code in :data:`_MYSQL_AUTH_REFUSED`."""
    orig = getattr(exc, "orig", None) or exc
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_AUTH_REFUSED:
        return type(orig).__module__.startswith("pymysql")
    return type(orig).__module__.startswith("psycopg") and bool(_PG_AUTH_REFUSED.search(str(orig)))


def _reason(exc: BaseException) -> str:
    """The driver's own message, first line, with its class."""
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines() or [""]
    return f"{type(orig).__name__}: {lines[0]}"


class SQLConnection(SQLDialects):
    """The engine of an SQL backend: made from the URL (or the user's), checked, its tables
    created, and every statement run through :meth:`_write` or :meth:`_read`."""

    prefix: str
    connect_timeout: float
    statement_timeout: float
    _url: URL
    _engine: Engine | None
    #: whether close() disposes the engine (False for a user's Engine)
    _owns_engine: bool
    #: the process that made the engine (a fork gets a fresh pool)
    _pid: int
    #: tables checked or created
    _ready: bool
    #: the client-side bound of each call (PostgreSQL, MySQL), or None
    _watchdog: _Watchdog | None

    def now_ms(self) -> int:
        """The database clock, epoch milliseconds (UTC): PostgreSQL
        ``clock_timestamp()``, MySQL ``UTC_TIMESTAMP(6)``, SQLite this
        process's clock.

        Raises:
            BackendUnavailable: no answer.
        """
        if self.kind == "sqlite":
            return self._process_now()
        with self._read("read the clock") as conn:
            return self._now(conn)

    def open(self) -> None:
        """Connect, create the tables if missing and check the schema version.

        Idempotent, and safe to run from several processes at once: each
        table is created with ``CREATE TABLE IF NOT EXISTS``, and a creation
        that fails because another process just created the table is fine.

        Raises:
            BackendUnavailable: the database cannot be reached or fails.
            ConfigurationError: the database refused the credentials (a wrong
                password, a role or user that does not exist); the SQLite
                file's directory does not exist; a
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
        try:
            with self._unavailable("open"):
                self._check_found_rows(self._engine)
                self._create_tables(self._engine)
                foreign = self._foreign_tables(self._engine)
                version = self._schema_version(self._engine) if not foreign else 0
        except BackendUnavailable as exc:
            cause = exc.__cause__
            if cause is not None and _auth_refused(cause):
                raise ConfigurationError(
                    f"anarchon_backend: {self.describe()} refused the credentials "
                    f"({_reason(cause)}); fix the user name or password in the URL, or create "
                    "that role or user in the database."
                ) from cause
            raise
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
        if self.kind != "sqlite":
            self._measure_clock_offset()
        logger.info("anarchon: SQL %s ready: %s", self.role, self.describe())

    def exists(self) -> bool:
        """False for a SQLite file that is not there yet (opening creates it)."""
        return self.kind != "sqlite" or os.path.exists(self._url.database or "")

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

    def request_timeout_s(self) -> float | None:
        """The client-side bound of one call, seconds: ``statement_timeout``
        plus :data:`WATCHDOG_SLACK_S` (PostgreSQL, MySQL); None on SQLite,
        which is embedded (no request can be held up on the way, so a claim
        needs no deadline)."""
        if self.kind == "sqlite":
            return None
        return self.statement_timeout + WATCHDOG_SLACK_S

    @contextmanager
    def _unavailable(self, what: str) -> Iterator[None]:
        """Raise driver and pool errors as BackendUnavailable; the block
        runs under the client-side bound (:class:`_Watchdog`)."""
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is None:
            bound: Any = nullcontext([])
        else:
            bound = watchdog.bound()
        with bound as armed:
            try:
                yield
            except _DRIVER_ERRORS as exc:
                why = _reason(exc)
                if armed and armed[0] == "timed out":
                    why = f"no answer within {watchdog.limit_s:g}s ({why})"  # type: ignore[union-attr]
                raise BackendUnavailable(f"{self.describe()}: {what} failed: {why}") from exc

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
        self._watchdog = _Watchdog(self.statement_timeout + WATCHDOG_SLACK_S)
        if self.kind == "postgresql":
            engine = sa.create_engine(self._url, connect_args=self._postgres_args(), **common)
            self._watchdog.listen(engine)
            _check_on_checkout(engine)
            return engine
        engine = sa.create_engine(
            self._url,
            isolation_level="READ COMMITTED",
            connect_args=self._mysql_args(),
            **common,
        )
        sa.event.listen(engine, "do_connect", _without_found_rows)
        self._watchdog.listen(engine)
        _check_on_checkout(engine)
        return engine

    def _postgres_args(self) -> dict[str, Any]:
        timeout_ms = int(self.statement_timeout * 1000)
        options = str(self._url.query.get("options", ""))
        return {
            "connect_timeout": max(2, math.ceil(self.connect_timeout)),
            "options": f"{options} -c statement_timeout={timeout_ms}".strip(),
            "tcp_user_timeout": timeout_ms,
            "keepalives": 1,
            "keepalives_idle": max(1, math.ceil(self.statement_timeout)),
            "keepalives_interval": 1,
            "keepalives_count": 3,
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
