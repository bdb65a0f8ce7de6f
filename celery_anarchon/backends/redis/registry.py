"""The live-instance registry of the Redis backend (``{P}:instances``,
``{P}:instance:<id>``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import cast

from ..base import InstanceInfo
from .history import RedisHistory, _text
from .scripts import REGISTER


def _instance(info: str | bytes, heartbeat_ms: str | bytes) -> InstanceInfo:
    fields = json.loads(info)
    return InstanceInfo.from_dict({**fields, "heartbeat_ms": int(heartbeat_ms)})


class RedisRegistry(RedisHistory):
    """Heartbeats and stored job definitions of live instances."""

    def register(self, info: InstanceInfo, ttl_ms: int) -> bool:
        """Add or refresh ``info`` with :data:`LUA_REGISTER_SCRIPT`; its
        ``heartbeat_ms`` becomes the server's now and it drops out ``ttl_ms``
        after this call unless refreshed. ``info.jobs``, when not empty, is
        stored in the instance hash's ``jobs`` field (see
        :meth:`Backend.register`).

        Returns:
            True when the instance hash holds definitions for
            ``info.fingerprint``.
        Raises:
            BackendUnavailable: no answer.
        """
        fields = asdict(info)
        fields.pop("heartbeat_ms")
        jobs = fields.pop("jobs")
        keys = [self._instance_key(info.instance), self._registry_key()]
        args = [
            info.instance,
            json.dumps(fields),
            ttl_ms,
            info.fingerprint,
            json.dumps(jobs) if jobs else "",
        ]
        _, stored = self._call((REGISTER, keys, args))
        return bool(stored)

    def unregister(self, instance: str) -> None:
        """Remove ``instance`` from the registry (graceful shutdown).

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("unregister"):
            pipe = self._require_client().pipeline(transaction=False)
            pipe.delete(self._instance_key(instance))
            pipe.zrem(self._registry_key(), instance)
            pipe.execute()

    def instances(self) -> list[InstanceInfo]:
        """The live instances (those whose hash has not expired), oldest
        start first. Two round trips: the index, then the instances' hashes.
        Dead index entries are pruned by :meth:`register`.

        Raises:
            BackendUnavailable: no answer.
        """
        client = self._require_client()
        with self._translated("instances"):
            members = cast("list[str | bytes]", client.zrange(self._registry_key(), 0, -1))
            pipe = client.pipeline(transaction=False)
            for member in members:
                pipe.hmget(self._instance_key(_text(member)), ["info", "heartbeat_ms"])
            found = pipe.execute() if members else []
        infos = [
            _instance(info, beat) for info, beat in found if info is not None and beat is not None
        ]
        return sorted(infos, key=lambda i: (i.started_ms, i.instance))

    def definitions(self, instance: str) -> dict[str, str]:
        """The definitions ``instance`` stored with :meth:`register`
        (``HGET`` of its hash's ``jobs`` field), empty when none.

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("definitions"):
            raw = self._require_client().hget(self._instance_key(instance), "jobs")
        return dict(json.loads(raw)) if raw else {}
