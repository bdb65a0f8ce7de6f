"""Stored jobs in the Redis backend (docs/runtime-schedules.md).

Three keys under the registry's hash tag ``{P}``, so Redis Cluster keeps
them in one slot:

* ``{P}:stored``: a hash, field ``<kind>:<name>``, value
  ``<version>:<committed_ms>:<prior>|B<body>`` (``R`` and no body once
  removed; ``<prior>`` the earlier writes, ``v,c;v,c``, newest first);
* ``{P}:stored:log``: a sorted set of the same fields scored by version;
* ``{P}:stored:version``: the change counter.

A write is one script (:data:`LUA_WRITE_STORED_SCRIPT`): it checks the
condition, takes the next version with ``INCR``, reads the server's
``TIME`` and writes the hash and the log, so no reader ever sees one
without the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..store import PRIOR_WRITES, StoredJobsStore, StoredRecord, StoredWrite, parse_prior
from .registry import RedisRegistry
from .scripts import _script

__all__ = ["RedisStored"]

LUA_WRITE_STORED_SCRIPT = """
-- KEYS: hash, log, counter. ARGV[1]: most earlier writes kept; then, per
-- write, four: field, body ('' to remove), remove ('1'/'0'), exists ('1':
-- must be there, '0': must not, '': either). All or none: false when some
-- exists does not hold; else per write {version, now, prior}, or {0} for the
-- removal of a field that is not there.
local keep = tonumber(ARGV[1])
local n = (#ARGV - 1) / 4
local currents = {}
for i = 1, n do
    local field, cond = ARGV[4 * i - 2], ARGV[4 * i + 1]
    local current = redis.call('HGET', KEYS[1], field)
    local present = false
    if current then
        local _, _, flag = string.find(current, '^%d+:%d+:[%d,;]*|(.)')
        present = flag == 'B'
    end
    if (cond == '1' and not present) or (cond == '0' and present) then
        return false
    end
    currents[i] = current or false
end
local now = now_ms()
local out = {}
for i = 1, n do
    local field, body, remove = ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
    local current = currents[i]
    if not current and remove == '1' then
        out[i] = {0}
    else
        local prior = ''
        if current then
            local _, _, v, c, p = string.find(current, '^(%d+):(%d+):([%d,;]*)|')
            prior = v .. ',' .. c
            local kept = 1
            for item in string.gmatch(p, '[^;]+') do
                if kept >= keep then break end
                prior = prior .. ';' .. item
                kept = kept + 1
            end
        end
        local version = redis.call('INCR', KEYS[3])
        local value = int(version) .. ':' .. int(now) .. ':' .. prior .. '|'
        if remove == '1' then value = value .. 'R' else value = value .. 'B' .. body end
        redis.call('HSET', KEYS[1], field, value)
        redis.call('ZADD', KEYS[2], version, field)
        out[i] = {version, now, prior}
    end
end
return out
"""

LUA_STORED_CHANGES_SCRIPT = """
-- KEYS: hash, log. ARGV: since. Flat {field, value, field, value, ...}.
local fields = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[1], '+inf')
local out = {}
local chunk = 1000
for i = 1, #fields, chunk do
    local part = {}
    for j = i, math.min(i + chunk - 1, #fields) do part[#part + 1] = fields[j] end
    local values = redis.call('HMGET', KEYS[1], unpack(part))
    for j = 1, #part do
        out[#out + 1] = part[j]
        out[#out + 1] = values[j] or ''
    end
end
return out
"""

WRITE_STORED = _script("write_stored", LUA_WRITE_STORED_SCRIPT)
STORED_CHANGES = _script("stored_changes", LUA_STORED_CHANGES_SCRIPT)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _record(field: bytes | str, value: bytes | str) -> StoredRecord | None:
    """A record from its hash field and value; None for a value that is
    not there (written by nobody this version knows)."""
    kind, _, name = _text(field).partition(":")
    text = _text(value)
    version, _, rest = text.partition(":")
    committed, _, rest = rest.partition(":")
    prior, _, rest = rest.partition("|")
    if not version.isdigit() or not committed.isdigit() or rest[:1] not in ("B", "R"):
        return None
    body = rest[1:] if rest[:1] == "B" else None
    return StoredRecord(kind, name, body, int(version), int(committed), parse_prior(prior))


class RedisStored(RedisRegistry, StoredJobsStore):
    """Stored-job definitions and pause states in three keys (module docstring)."""

    def _stored_keys(self) -> list[str]:
        tag = "{" + self.prefix + "}"
        return [f"{tag}:stored", f"{tag}:stored:log", f"{tag}:stored:version"]

    def stored_version(self) -> int:
        """The change counter (one ``GET``), 0 before any write.

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("GET stored version"):
            value = self._require_client().get(self._stored_keys()[2])
        return int(value) if value is not None else 0

    def stored_changes(self, since: int = 0) -> list[StoredRecord]:
        """Every record written after version ``since``, oldest first (one script).

        Raises:
            BackendUnavailable: no answer.
        """
        flat = self._call((STORED_CHANGES, self._stored_keys()[:2], [since]))
        records = []
        for i in range(0, len(flat), 2):
            record = _record(flat[i], flat[i + 1])
            if record is not None:
                records.append(record)
        return records

    def stored_records(self, names: Sequence[str], kind: str) -> dict[str, StoredRecord]:
        """The current records of ``names`` of one ``kind`` (one ``HMGET``).

        Raises:
            BackendUnavailable: no answer.
        """
        if not names:
            return {}
        fields = [f"{kind}:{name}" for name in names]
        with self._translated("HMGET stored"):
            values = self._require_client().hmget(self._stored_keys()[0], fields)
        found = {}
        for field, value in zip(fields, values, strict=True):
            record = _record(field, value) if value is not None else None
            if record is not None and record.body is not None:
                found[record.name] = record
        return found

    def write_stored_many(self, writes: Sequence[StoredWrite]) -> list[StoredRecord | None] | None:
        """Write records under the next versions, all or none (one script).

        Returns:
            one record per write (None for the removal of a record that is
            not there), or None when some ``exists`` did not hold.
        Raises:
            BackendUnavailable: no answer (the script ran wholly or not at all).
        """
        args: list[Any] = [PRIOR_WRITES]
        for w in writes:
            condition = "" if w.exists is None else ("1" if w.exists else "0")
            remove = "1" if w.body is None else "0"
            args += [f"{w.kind}:{w.name}", w.body or "", remove, condition]
        reply = self._call((WRITE_STORED, self._stored_keys(), args))
        if not reply:
            return None
        written: list[StoredRecord | None] = []
        for w, answer in zip(writes, reply, strict=True):
            if len(answer) == 1:
                written.append(None)
                continue
            version, committed, prior = answer
            written.append(
                StoredRecord(
                    w.kind, w.name, w.body, int(version), int(committed), parse_prior(_text(prior))
                )
            )
        return written
