"""The live-instance registry of the SQL backend (``<prefix>instances`` and
``<prefix>schedules``).
"""

from __future__ import annotations

import json
from dataclasses import asdict

import sqlalchemy as sa

from ..base import InstanceInfo
from .history import SQLHistory
from .naming import key_of


class SQLRegistry(SQLHistory):
    """Heartbeats and stored job definitions of live instances."""

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
