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

from .backend import SQLBackend
from .connection import CLIENT_FOUND_ROWS, DRIVERS
from .naming import SCHEMA_VERSION, key_of

__all__ = ["CLIENT_FOUND_ROWS", "DRIVERS", "SCHEMA_VERSION", "SQLBackend", "key_of"]
