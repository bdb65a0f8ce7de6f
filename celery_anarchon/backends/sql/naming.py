"""Table and key naming of the SQL backend: the seven tables under a prefix, and
the stored form of job names, manual keys and instance ids.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_sql
from sqlalchemy.engine import Dialect

from ...exceptions import ConfigurationError

#: Version of the table layout, kept in ``<prefix>meta``; a later layout
#: migrates from it.
SCHEMA_VERSION = 1


#: Most characters of a job name, manual key or instance id stored as is;
#: longer ones are stored as a prefix plus their SHA-256 (see :func:`key_of`).
KEY_CHARS = 255


_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}\Z")


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


@dataclass(frozen=True)
class _Tables:
    metadata: sa.MetaData
    runs: sa.Table
    manual: sa.Table
    instances: sa.Table
    schedules: sa.Table
    meta: sa.Table
    stored: sa.Table
    won: sa.Table


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
    stored = sa.Table(
        f"{prefix}stored",
        md,
        sa.Column("kind", sa.String(8), primary_key=True),
        sa.Column("name", _Key(), primary_key=True),
        sa.Column("full_name", sa.Text, nullable=False),
        sa.Column("body", sa.Text),
        _ms("version", nullable=False),
        _ms("committed_ms", nullable=False),
        sa.Column("prior", sa.String(255), nullable=False, default=""),
        sa.UniqueConstraint("version", name=f"{prefix}stored_version"),
        **opts,
    )
    won = sa.Table(
        f"{prefix}won",
        md,
        sa.Column("job", _Key(), primary_key=True),
        _ms("won", nullable=False),
        **opts,
    )
    return _Tables(md, runs, manual, instances, schedules, meta, stored, won)


def _prefix(value: Any) -> str:
    if not isinstance(value, str) or not _PREFIX_RE.match(value):
        raise ConfigurationError(
            f"anarchon_backend_options['prefix']: {value!r} is not a usable table-name "
            "prefix; use letters, digits and '_' (at most 40, not starting with a digit), "
            "e.g. 'anarchon_'."
        )
    return value


def _kind_of(dialect_name: str) -> str:
    """``sqlite``, ``postgresql`` or ``mysql`` (MariaDB included)."""
    return "mysql" if dialect_name == "mariadb" else dialect_name
