"""Redis lease backend: one Lua script per claim operation, judged by the
server's clock.

Key layout, for job ``J`` under the prefix ``P`` (default ``anarchon:``).
Every key of a job carries the hash tag ``{PJ}``, so each script touches a
single Redis Cluster slot:

============================  ========  =====================================
key                           type      holds
============================  ========  =====================================
``{PJ}:slot:<slot_ms>``       string    the claim key guarding one slot: the
                                        current fencing token (``> 0``), ``0``
                                        when closed by a missed/skipped record,
                                        ``-token`` when released. Expires at
                                        ``keep_until_ms`` (``PEXPIREAT``).
``{PJ}:runs``                 hash      history: member -> JSON run record
``{PJ}:index``                zset      history members scored by slot (ms)
``{PJ}:manual:<key>``         string    a manual run's key -> its slot (ms);
                                        expires at ``keep_until_ms``
``{P}:instances``             zset      instance id scored by expiry (ms)
``{P}:instance:<id>``         hash      ``info`` (JSON), ``heartbeat_ms``
============================  ========  =====================================

A history member is the slot as a decimal string for the slot's current
record, and ``<slot_ms>/<token>`` for a record superseded by a takeover
(scored ``slot_ms - 0.5`` so it sorts just below the current one).
"""

from .backend import RedisBackend

__all__ = ["RedisBackend"]
