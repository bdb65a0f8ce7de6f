"""Parked tasks in Redis: a sorted set scored by due time, the payloads
kept apart, sharded over :data:`SHARDS` hash tags (docs/delayed-tasks.md).

Shard ``n`` of prefix ``P`` (``anarchon:`` by default) keeps its keys under
the hash tag ``{Pdelayed:n}`` (``{anarchon:delayed:3}``), so Redis Cluster
keeps a shard in one slot:

* ``:ready``: sorted set of ids, scored by the time the task can be taken,
  epoch ms: its due time while pending, its lease's expiry while in flight;
* ``:task``: hash, id -> payload (JSON text);
* ``:flight``: hash, id -> fencing token, for the tasks in flight;
* ``:fail``: hash, id -> ``<attempts>|<error>`` of failed publishes;
* ``:key`` / ``:keyof``: hashes, key -> id and id -> key;
* ``:fence``: the shard's fencing-token counter;
* ``:started:<id>``: the worker gate's mark, with a TTL.

A task's shard is ``crc32(key) % SHARDS`` when it has a key, else
``crc32(id) % SHARDS``; a keyed task's id is drawn until its own crc32 falls
in that shard, so an id always names its shard (and a key too). Every
change is one Lua script on one shard, judged by the server's ``TIME``.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

import redis

from ..backends.redis import RedisBackend
from ..backends.redis.scripts import _Call, _script
from ..exceptions import BackendUnavailable
from .model import IN_FLIGHT, PENDING, Parked, ParkedTask, Taken
from .store import DelayedStore, Listener

__all__ = ["SHARDS", "RedisDelayedStore"]

#: Shards of one prefix: fixed, so every host agrees where a task lives.
SHARDS = 16

_KEYS = ("ready", "task", "flight", "fail", "key", "keyof", "fence")

LUA_PARK = """
-- KEYS: the shard's keys (_KEYS). ARGV: id, key ('' for none), due_ms,
-- payload, wake channel. Returns the id of the task parked (an existing one
-- under the key, or this one).
local id, key, due = ARGV[1], ARGV[2], tonumber(ARGV[3])
if key ~= '' then
    local existing = redis.call('HGET', KEYS[5], key)
    if existing and redis.call('HEXISTS', KEYS[2], existing) == 1 then
        return existing
    end
end
if redis.call('HEXISTS', KEYS[2], id) == 1 then
    return id
end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[1], due, id)
redis.call('HSET', KEYS[2], id, ARGV[4])
if key ~= '' then
    redis.call('HSET', KEYS[5], key, id)
    redis.call('HSET', KEYS[6], id, key)
end
if #head == 0 or due < tonumber(head[2]) then
    redis.call('PUBLISH', ARGV[5], due)
end
return id
"""

LUA_TAKE = """
-- KEYS: the shard's keys. ARGV: limit, lease_ms. Takes what is due by the
-- server's clock under new leases. Returns {now, then per task: id, token,
-- taken_over (0/1), payload, fail, key, due}.
local now = now_ms()
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0,
    tonumber(ARGV[1]))
local out = {now}
for i = 1, #ids, 2 do
    local id, score = ids[i], ids[i + 1]
    local payload = redis.call('HGET', KEYS[2], id)
    if payload then
        local before = redis.call('HGET', KEYS[3], id)
        local token = redis.call('INCR', KEYS[7])
        redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), id)
        redis.call('HSET', KEYS[3], id, token)
        table.insert(out, id)
        table.insert(out, token)
        table.insert(out, before and 1 or 0)
        table.insert(out, payload)
        table.insert(out, redis.call('HGET', KEYS[4], id) or '')
        table.insert(out, redis.call('HGET', KEYS[6], id) or '')
        table.insert(out, score)
    else
        redis.call('ZREM', KEYS[1], id)
    end
end
return out
"""

LUA_FINISH = """
-- KEYS: the shard's keys. ARGV: pairs of id, token. Deletes each task whose
-- lease is still current. Returns 1/0 per pair.
local out = {}
for i = 1, #ARGV, 2 do
    local id, token = ARGV[i], ARGV[i + 1]
    if redis.call('HGET', KEYS[3], id) == token then
        forget(KEYS, id)
        table.insert(out, 1)
    else
        table.insert(out, 0)
    end
end
return out
"""

LUA_GIVE_BACK = """
-- KEYS: the shard's keys. ARGV: retry_at_ms, error, failed ('1': count the
-- attempt and keep the error; '0': leave both), then pairs of id, token.
-- Makes each task whose lease is current pending again at retry_at_ms.
-- Returns 1/0 per pair.
local out = {}
for i = 4, #ARGV, 2 do
    local id, token = ARGV[i], ARGV[i + 1]
    if redis.call('HGET', KEYS[3], id) == token then
        local fail = redis.call('HGET', KEYS[4], id)
        local attempts = 0
        if fail then
            attempts = tonumber(string.match(fail, '^(%d+)|')) or 0
        end
        redis.call('HDEL', KEYS[3], id)
        redis.call('ZADD', KEYS[1], tonumber(ARGV[1]), id)
        if ARGV[3] == '1' then
            redis.call('HSET', KEYS[4], id, (attempts + 1) .. '|' .. ARGV[2])
        end
        table.insert(out, 1)
    else
        table.insert(out, 0)
    end
end
return out
"""

LUA_CHANGE = """
-- KEYS: the shard's keys. ARGV: key_or_id, action ('cancel' or
-- 'reschedule'), due_ms, wake channel. Acts on a pending task only.
-- Returns 1 when done, 0 when no such task or it is in flight.
local id = redis.call('HGET', KEYS[5], ARGV[1])
if not id or redis.call('HEXISTS', KEYS[2], id) == 0 then
    id = ARGV[1]
end
if redis.call('HEXISTS', KEYS[2], id) == 0 or redis.call('HEXISTS', KEYS[3], id) == 1 then
    return 0
end
if ARGV[2] == 'cancel' then
    forget(KEYS, id)
    return 1
end
local due = tonumber(ARGV[3])
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[1], due, id)
if #head == 0 or due < tonumber(head[2]) then
    redis.call('PUBLISH', ARGV[4], due)
end
return 1
"""

#: Shared by the scripts that delete a task (finish, cancel): every trace of
#: ``id`` in the shard, and its key's entry while the key still names it.
LUA_FORGET = """
local function forget(keys, id)
    local key = redis.call('HGET', keys[6], id)
    redis.call('ZREM', keys[1], id)
    for _, index in ipairs({2, 3, 4, 6}) do
        redis.call('HDEL', keys[index], id)
    end
    if key and redis.call('HGET', keys[5], key) == id then
        redis.call('HDEL', keys[5], key)
    end
end
"""

PARK = _script("delayed_park", LUA_PARK)
TAKE = _script("delayed_take", LUA_TAKE)
FINISH = _script("delayed_finish", LUA_FORGET + LUA_FINISH)
GIVE_BACK = _script("delayed_give_back", LUA_GIVE_BACK)
CHANGE = _script("delayed_change", LUA_FORGET + LUA_CHANGE)


def shard_of(text: str) -> int:
    """The shard of a key or id: ``crc32(utf-8) % SHARDS``."""
    return zlib.crc32(text.encode("utf-8")) % SHARDS


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class _RedisListener(Listener):
    """A pub/sub subscription to the store's wake channel."""

    def __init__(self, store: RedisDelayedStore) -> None:
        self._store = store
        self._pubsub: Any = None

    def _subscribed(self) -> Any:
        if self._pubsub is None:
            client = self._store.backend._require_client()
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            with self._store.backend._translated("SUBSCRIBE"):
                pubsub.subscribe(self._store.channel)
            self._pubsub = pubsub
        return self._pubsub

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            pubsub = self._subscribed()
            while True:
                # None also for a subscribe confirmation (ignored): wait on
                # until a message or the deadline.
                message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None and message.get("type") == "message":
                    # Drain what else arrived: one wake-up serves them all.
                    while pubsub.get_message(timeout=0) is not None:
                        pass
                    return True
                if time.monotonic() >= deadline:
                    return False
        except redis.RedisError as exc:
            self.close()
            raise BackendUnavailable(
                f"Redis pub/sub on {self._store.describe()} failed: {exc}"
            ) from exc

    def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):  # the connection is gone already
                pubsub.close()


class RedisDelayedStore(DelayedStore):
    """Parked tasks in a :class:`~celery_anarchon.backends.redis.RedisBackend`'s
    Redis, under its prefix (module docs give the keys)."""

    kind = "redis"

    def __init__(self, backend: RedisBackend) -> None:
        self.backend = backend
        base = backend.prefix + "delayed:"
        self._tags = ["{" + base + str(n) + "}" for n in range(SHARDS)]
        self._keys = [[f"{tag}:{name}" for name in _KEYS] for tag in self._tags]
        #: the pub/sub channel parks and earlier reschedules announce on
        self.channel = backend.prefix + "delayed:wake"

    def describe(self) -> str:
        return f"delayed store in {self.backend.describe()}"

    def now_ms(self) -> int:
        return self.backend.now_ms()

    def new_id(self, key: str | None) -> str:
        if key is None:
            return str(uuid.uuid4())
        shard = shard_of(key)
        while True:  # SHARDS draws on average
            candidate = str(uuid.uuid4())
            if shard_of(candidate) == shard:
                return candidate

    def _shard(self, parked: Parked) -> int:
        return shard_of(parked.key if parked.key is not None else parked.id)

    def park(self, tasks: Sequence[Parked]) -> list[str]:
        calls: list[_Call] = []
        for task in tasks:
            shard = self._shard(task)
            if task.key is not None and shard_of(task.id) != shard:
                raise ValueError(
                    f"park: task id {task.id!r} is not in key {task.key!r}'s shard; "
                    "let the store choose a keyed task's id"
                )
            calls.append(
                (
                    PARK,
                    self._keys[shard],
                    [task.id, task.key or "", task.due_ms, task.payload, self.channel],
                )
            )
        return [_text(reply) for reply in self._replies(calls)]

    def _replies(self, calls: Sequence[_Call]) -> list[Any]:
        out: list[Any] = []
        for start in range(0, len(calls), 1000):
            chunk = calls[start : start + 1000]
            replies = self.backend._run(chunk)
            for call, reply in zip(chunk, replies, strict=True):
                if isinstance(reply, Exception):
                    raise self.backend._unavailable(call[0].name, reply) from reply
                out.append(reply)
        return out

    def _change(self, key_or_id: str, action: str, due_ms: int = 0) -> bool:
        keys = self._keys[shard_of(key_or_id)]
        [reply] = self._replies([(CHANGE, keys, [key_or_id, action, due_ms, self.channel])])
        return bool(int(reply))

    def cancel(self, key_or_id: str) -> bool:
        return self._change(key_or_id, "cancel")

    def reschedule(self, key_or_id: str, due_ms: int) -> bool:
        return self._change(key_or_id, "reschedule", due_ms)

    def get(self, key_or_id: str) -> ParkedTask | None:
        client = self.backend._require_client()
        with self.backend._translated("delayed get"):
            found = client.hget(self._keys[shard_of(key_or_id)][4], key_or_id)
        if found is not None:
            task = self._get_id(_text(found))
            if task is not None:
                return task
        return self._get_id(key_or_id)

    def _get_id(self, task_id: str) -> ParkedTask | None:
        keys = self._keys[shard_of(task_id)]
        client = self.backend._require_client()
        with self.backend._translated("delayed get"):
            pipe = client.pipeline(transaction=False)
            pipe.hget(keys[1], task_id)
            pipe.zscore(keys[0], task_id)
            pipe.hget(keys[2], task_id)
            pipe.hget(keys[3], task_id)
            pipe.hget(keys[5], task_id)
            payload, score, token, fail, key = pipe.execute()
        return _task(task_id, payload, score, token, fail, key)

    def pending(self, limit: int, before_ms: int | None = None) -> list[ParkedTask]:
        if limit <= 0:
            return []
        client = self.backend._require_client()
        high = "+inf" if before_ms is None else f"({before_ms}"
        with self.backend._translated("delayed pending"):
            pipe = client.pipeline(transaction=False)
            for keys in self._keys:
                pipe.zrangebyscore(keys[0], "-inf", high, start=0, num=limit, withscores=True)
            heads = pipe.execute()
            merged = heapq.nsmallest(
                limit,
                ((score, _text(m), n) for n, rows in enumerate(heads) for m, score in rows),
            )
            pipe = client.pipeline(transaction=False)
            for _, task_id, n in merged:
                keys = self._keys[n]
                pipe.hget(keys[1], task_id)
                pipe.hget(keys[2], task_id)
                pipe.hget(keys[3], task_id)
                pipe.hget(keys[5], task_id)
            rows = pipe.execute()
        out = []
        for i, (score, task_id, _) in enumerate(merged):
            payload, token, fail, key = rows[4 * i : 4 * i + 4]
            task = _task(task_id, payload, score, token, fail, key)
            if task is not None:
                out.append(task)
        return out

    def count(self) -> int:
        client = self.backend._require_client()
        with self.backend._translated("delayed count"):
            pipe = client.pipeline(transaction=False)
            for keys in self._keys:
                pipe.zcard(keys[0])
            return int(sum(pipe.execute()))

    def next_due_ms(self) -> int | None:
        client = self.backend._require_client()
        with self.backend._translated("delayed next due"):
            pipe = client.pipeline(transaction=False)
            for keys in self._keys:
                pipe.zrange(keys[0], 0, 0, withscores=True)
            heads = [rows[0][1] for rows in pipe.execute() if rows]
        return int(min(heads)) if heads else None

    def due_in_ms(self) -> int | None:
        # One round trip: the server's clock and every shard's head.
        client = self.backend._require_client()
        with self.backend._translated("delayed next due"):
            pipe = client.pipeline(transaction=False)
            pipe.time()
            for keys in self._keys:
                pipe.zrange(keys[0], 0, 0, withscores=True)
            (seconds, micros), *rows = pipe.execute()
        heads = [found[0][1] for found in rows if found]
        if not heads:
            return None
        return int(min(heads)) - (int(seconds) * 1000 + int(micros) // 1000)

    def take_due(self, limit: int, lease_ms: int, owner: str) -> list[Taken]:
        # The ``limit`` earliest due over all shards: read the server's
        # clock, then each shard's due ids (one pipeline), pick the earliest
        # ``limit``, and take that many from each shard in one pipeline of
        # scripts, each judging "due" again by TIME (a concurrent taker
        # makes a shard give fewer, never one not due).
        now = self.now_ms()
        # Each shard's earliest due, at most twice its even share (a burst
        # spreads evenly over the shards; one that holds more gives its
        # share now and the rest next round): not 16 x limit ids to read.
        per_shard = min(limit, max(8, 2 * -(-limit // SHARDS)))
        client = self.backend._require_client()
        with self.backend._translated("delayed due"):
            pipe = client.pipeline(transaction=False)
            for keys in self._keys:
                pipe.zrangebyscore(keys[0], "-inf", now, start=0, num=per_shard, withscores=True)
            heads = pipe.execute()
        picked = heapq.nsmallest(
            limit, ((score, n) for n, rows in enumerate(heads) for _, score in rows)
        )
        shares = [0] * SHARDS
        for _, n in picked:
            shares[n] += 1
        calls: list[_Call] = [
            (TAKE, self._keys[n], [share, lease_ms]) for n, share in enumerate(shares) if share
        ]
        if not calls:
            return []
        taken: list[Taken] = []
        for reply in self._replies(calls):
            now = int(reply[0])
            for i in range(1, len(reply), 7):
                task_id, token, over, payload, fail, key, score = reply[i : i + 7]
                attempts, error = _fail(fail)
                task = ParkedTask(
                    id=_text(task_id),
                    key=_text(key) or None,
                    task=_task_name(payload),
                    due_ms=int(float(score)),
                    state=IN_FLIGHT,
                    payload=_text(payload),
                    attempts=attempts,
                    error=error,
                    token=int(token),
                )
                taken.append(Taken(task, int(token), bool(int(over)), now))
        taken.sort(key=lambda t: t.task.due_ms)
        return taken

    def _by_shard(self, taken: Sequence[Taken]) -> dict[int, list[int]]:
        shards: dict[int, list[int]] = {}
        for index, item in enumerate(taken):
            shards.setdefault(shard_of(item.task.id), []).append(index)
        return shards

    def _fenced(self, script: Any, taken: Sequence[Taken], head: Sequence[Any]) -> list[bool]:
        shards = self._by_shard(taken)
        calls: list[_Call] = []
        for shard, indexes in shards.items():
            args = list(head)
            for index in indexes:
                args += [taken[index].task.id, taken[index].token]
            calls.append((script, self._keys[shard], args))
        done = [False] * len(taken)
        for (_shard, indexes), reply in zip(shards.items(), self._replies(calls), strict=True):
            for index, flag in zip(indexes, reply, strict=True):
                done[index] = bool(int(flag))
        return done

    def finish(self, taken: Sequence[Taken]) -> list[bool]:
        return self._fenced(FINISH, taken, []) if taken else []

    def give_back(
        self, taken: Sequence[Taken], retry_at_ms: int, error: str, *, failed: bool = True
    ) -> list[bool]:
        if not taken:
            return []
        head = [retry_at_ms, error[:1000], "1" if failed else "0"]
        return self._fenced(GIVE_BACK, taken, head)

    def mark_started(self, task_id: str, keep_ms: int, owner: str = "") -> bool:
        key = f"{self._tags[shard_of(task_id)]}:started:{task_id}"
        client = self.backend._require_client()
        with self.backend._translated("delayed start gate"):
            if client.set(key, owner or "1", nx=True, px=max(1, int(keep_ms))):
                return True
            # Ours when an earlier call of this delivery set it (its answer lost).
            return bool(owner) and _text(client.get(key) or b"") == owner

    def listener(self) -> Listener:
        return _RedisListener(self)

    def close(self) -> None:
        self.backend.close()


def _fail(value: Any) -> tuple[int, str | None]:
    text = _text(value) if value else ""
    if not text:
        return 0, None
    attempts, _, error = text.partition("|")
    return int(attempts or 0), error or None


def _task_name(payload: Any) -> str:
    return str(json.loads(_text(payload)).get("task", ""))


def _task(
    task_id: str, payload: Any, score: Any, token: Any, fail: Any, key: Any
) -> ParkedTask | None:
    if payload is None or score is None:
        return None
    attempts, error = _fail(fail)
    return ParkedTask(
        id=task_id,
        key=_text(key) if key else None,
        task=_task_name(payload),
        due_ms=int(float(score)),
        state=IN_FLIGHT if token is not None else PENDING,
        payload=_text(payload),
        attempts=attempts,
        error=error,
        token=int(token) if token is not None else 0,
    )
