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

from __future__ import annotations

import difflib
import functools
import hashlib
import inspect
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..exceptions import BackendUnavailable, ConfigurationError
from . import sanitize_url
from .base import AbsentRecord, Backend, Claim, ClaimRequest, InstanceInfo, RunRecord, State

__all__ = ["RedisBackend"]

logger = logging.getLogger(__name__)

#: Default history bounds for manual runs (``claim_manual`` takes none).
DEFAULT_HISTORY_TTL_MS = 7 * 24 * 3600 * 1000
#: Lease of a manual run, milliseconds.
MANUAL_LEASE_MS = 60_000
#: Oldest Redis the scripts run on (``SET .. PXAT`` and ``KEEPTTL``).
MIN_REDIS = (6, 2)
#: Default Sentinel port.
SENTINEL_PORT = 26379
#: Jobs per pipeline when reading the last slots at start-up.
LAST_SLOTS_CHUNK = 1000

# Helpers shared by the scripts below (prepended to each).
#   now_ms()                 server clock (TIME), epoch ms
#   int(x)                   a number as a decimal string without exponent
#   keep_key_until(k, t, n, m)  make key k live at least until t (never
#       shortens); when it must move, it moves to t + m (m ms of headroom,
#       default 0), so the writes that follow find it long enough
#   keep_history_until(runs, index, t, n, m)  keep_key_until for a job's two
#       history keys, which always carry the same expiry: one PTTL (the
#       index's) tells for both
#   put_run(runs, index, member, score, run)   write one history record
#   trim(runs, index, size, ttl, now)  once the history holds more than
#       size + slack records (slack: a tenth of size, at least 1), or its
#       oldest is older than ttl (by slot): drop records older than ttl and
#       the oldest beyond size, but never one whose keep_until_ms is still
#       ahead: that record guards its slot together with the claim key.
#       Oldest first, it stops at the first scheduled record still kept
#       (later ones are kept too), stepping over manual runs (kept a day).
#       Amortised: most writes only count the records and read the oldest.
#   set_guard(k, v, t, n)    set claim key k to v, expiring at t (or later,
#       if it already expires later); deleted when t is not ahead of now
#   outside_window(slot, now, before, after)   the claim window test
_LUA_HELPERS = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(x)
    return string.format('%d', x)
end

local function keep_key_until(key, until_ms, now, headroom)
    until_ms = math.max(until_ms, now + 1)
    local pttl = redis.call('PTTL', key)
    if pttl == -1 or (pttl >= 0 and now + pttl < until_ms) then
        redis.call('PEXPIREAT', key, int(until_ms + (headroom or 0)))
    end
end

local function keep_history_until(runs, index, until_ms, now, headroom)
    until_ms = math.max(until_ms, now + 1)
    local pttl = redis.call('PTTL', index)
    if pttl == -1 or (pttl >= 0 and now + pttl < until_ms) then
        redis.call('PEXPIREAT', runs, int(until_ms + headroom))
        redis.call('PEXPIREAT', index, int(until_ms + headroom))
    end
end

local function put_run(runs, index, member, score, run)
    redis.call('HSET', runs, member, cjson.encode(run))
    redis.call('ZADD', index, score, member)
end

local function trim(runs, index, size, ttl, now)
    local count = redis.call('ZCARD', index)
    if count <= size + math.max(1, math.floor(size / 10)) then
        local oldest = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
        if oldest[2] == nil or tonumber(oldest[2]) >= now - ttl then
            return
        end
    end
    local doomed = redis.call('ZRANGEBYSCORE', index, '-inf', '(' .. int(now - ttl))
    local excess = count - size
    if excess > 0 then
        for _, member in ipairs(redis.call('ZRANGE', index, 0, excess - 1)) do
            doomed[#doomed + 1] = member
        end
    end
    -- Oldest first: a scheduled record's keep_until_ms grows with its slot,
    -- so past the first one still kept (a job due more often than max_late
    -- and max_skew allow to forget) every later one is kept too. Stopping
    -- there keeps a frequent job's claims from reading its whole excess each
    -- time. A manual run (run_now) is kept a day whatever its slot: it is
    -- stepped over, not stopped at.
    for _, member in ipairs(doomed) do
        local raw = redis.call('HGET', runs, member)
        local run = {}
        if raw then
            run = cjson.decode(raw)
        end
        local keep = run.keep_until_ms or 0
        if keep <= now then
            redis.call('HDEL', runs, member)
            redis.call('ZREM', index, member)
        elseif not run.manual_key then
            break
        end
    end
end

local function set_guard(key, value, keep_until, now)
    if keep_until <= now then
        redis.call('DEL', key)
    elseif redis.call('PTTL', key) < 0 then
        redis.call('SET', key, value, 'PXAT', int(keep_until))
    else
        redis.call('SET', key, value, 'KEEPTTL')
        keep_key_until(key, keep_until, now)
    end
end

local function outside_window(slot, now, before, after)
    return slot < now - before or slot > now + after
end
"""

# Claim one slot.
# KEYS[1] - claim key        {PJ}:slot:<slot_ms>
# KEYS[2] - history records  {PJ}:runs
# KEYS[3] - history index    {PJ}:index
# ARGV[1] - slot_ms
# ARGV[2] - instance id (the owner)
# ARGV[3] - window_before_ms
# ARGV[4] - window_after_ms
# ARGV[5] - keep_until_ms (absolute epoch ms: PEXPIREAT of the claim key)
# ARGV[6] - lease_ms
# ARGV[7] - history_size
# ARGV[8] - history_ttl_ms
# return the fencing token (>= 1) when won, 0 when taken (claim key holds a
# token or a closing 0, or a record exists), -1 when outside the window
LUA_CLAIM_SCRIPT = """
local slot = tonumber(ARGV[1])
local now = now_ms()
if outside_window(slot, now, tonumber(ARGV[3]), tonumber(ARGV[4])) then
    return -1
end
local guard = redis.call('GET', KEYS[1])
if (guard and tonumber(guard) >= 0) or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
    return 0
end
local token = 1
if guard then
    token = 1 - tonumber(guard)
end
local keep_until = tonumber(ARGV[5])
if guard then
    set_guard(KEYS[1], token, keep_until, now)
elseif keep_until > now then  -- no key yet: nothing to keep or to read
    redis.call('SET', KEYS[1], token, 'PXAT', int(keep_until))
end
put_run(KEYS[2], KEYS[3], ARGV[1], ARGV[1], {
    slot_ms = slot, state = 'claimed', instance = ARGV[2], token = token,
    claimed_at_ms = now, lease_until_ms = now + tonumber(ARGV[6]),
    keep_until_ms = keep_until})
local ttl = tonumber(ARGV[8])
trim(KEYS[2], KEYS[3], tonumber(ARGV[7]), ttl, now)
keep_history_until(KEYS[2], KEYS[3], math.max(slot + ttl, keep_until), now, math.floor(ttl / 10))
return token
"""

# Take over a claimed slot whose lease has expired (backup runner).
# KEYS[1] - claim key        {PJ}:slot:<slot_ms>
# KEYS[2] - history records  {PJ}:runs
# KEYS[3] - history index    {PJ}:index
# ARGV[1..8] - as for LUA_CLAIM_SCRIPT
# return the new fencing token (old + 1) when taken over, -2 when the slot
# is a scheduled run still 'claimed' whose lease has not ended yet (its
# holder may still send it: check again at the lease's end), 0 when it is
# not 'claimed' (sent, or further) or a manual run, -1 when outside the
# window. The old record stays in history as 'superseded'. A
# slot with no record and no live claim (never claimed, or released on
# hand-over) is claimed as by LUA_CLAIM_SCRIPT.
LUA_TAKE_OVER_SCRIPT = """
local slot = tonumber(ARGV[1])
local now = now_ms()
if outside_window(slot, now, tonumber(ARGV[3]), tonumber(ARGV[4])) then
    return -1
end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then
    local guard = redis.call('GET', KEYS[1])
    if guard and tonumber(guard) >= 0 then
        return 0
    end
    local token = 1
    if guard then
        token = 1 - tonumber(guard)
    end
    local keep_until = tonumber(ARGV[5])
    set_guard(KEYS[1], token, keep_until, now)
    put_run(KEYS[2], KEYS[3], ARGV[1], ARGV[1], {
        slot_ms = slot, state = 'claimed', instance = ARGV[2], token = token,
        claimed_at_ms = now, lease_until_ms = now + tonumber(ARGV[6]),
        keep_until_ms = keep_until})
    return token
end
local run = cjson.decode(raw)
if run.state ~= 'claimed' or run.manual_key then
    return 0
end
if (run.lease_until_ms or 0) > now then
    return -2
end
local old = run.token
local keep_until = math.max(tonumber(ARGV[5]), run.keep_until_ms or 0)
run.state = 'superseded'
put_run(KEYS[2], KEYS[3], ARGV[1] .. '/' .. int(old), string.format('%.1f', slot - 0.5), run)
local token = old + 1
set_guard(KEYS[1], token, keep_until, now)
put_run(KEYS[2], KEYS[3], ARGV[1], ARGV[1], {
    slot_ms = slot, state = 'claimed', instance = ARGV[2], token = token,
    claimed_at_ms = now, lease_until_ms = now + tonumber(ARGV[6]),
    keep_until_ms = keep_until})
local ttl = tonumber(ARGV[8])
trim(KEYS[2], KEYS[3], tonumber(ARGV[7]), ttl, now)
keep_key_until(KEYS[2], math.max(slot + ttl, keep_until), now)
keep_key_until(KEYS[3], math.max(slot + ttl, keep_until), now)
return token
"""

# Move a run to a later state, fenced by its token.
# KEYS[1] - history records  {PJ}:runs
# ARGV[1] - slot_ms
# ARGV[2] - fencing token (decimal string)
# ARGV[3] - new state
# ARGV[4] - timestamp field to set to the server's now ('' for none)
# ARGV[5] - task id ('' to leave as is)
# ARGV[6] - error ('' to leave as is)
# return 1 when written, 0 when the slot's current record does not carry
# this token (taken over, released, or trimmed away), or the move is not
# forward: nothing is written then.
# A state only moves forward (claimed < sent < running < finished), so a
# second 'running' (a duplicate delivery: the worker's start gate) or any
# mark out of a finished state returns 0; a late 'sent' after the worker's
# 'succeeded' still sets sent_at_ms and the task id, and keeps 'succeeded'.
LUA_MARK_SCRIPT = """
local RANK = {claimed = 0, sent = 1, running = 2}
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
    return 0
end
local run = cjson.decode(raw)
if run.state == 'superseded' or run.token == nil or int(run.token) ~= ARGV[2] then
    return 0
end
local from, to = RANK[run.state] or 3, RANK[ARGV[3]] or 3
if ARGV[3] ~= 'sent' and to <= from then
    return 0
end
if to > from then
    run.state = ARGV[3]
end
if ARGV[4] ~= '' then
    run[ARGV[4]] = now_ms()
end
if ARGV[5] ~= '' then
    run.task_id = ARGV[5]
end
if ARGV[6] ~= '' then
    run.error = ARGV[6]
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(run))
return 1
"""

# Extend a running run's lease (worker heartbeat), fenced by its token; or
# restart a running run whose lease expired (acks_late redelivery).
# KEYS[1] - history records  {PJ}:runs
# ARGV[1] - slot_ms
# ARGV[2] - fencing token (decimal string)
# ARGV[3] - lease_ms
# ARGV[4] - '1' to restart (only when the lease has expired), '' otherwise
# return 1 when written (lease_until_ms = server now + lease_ms; on restart
# started_at_ms = now too), 0 when the record is not 'running' with this
# token, or (restart) its lease has not expired.
LUA_EXTEND_SCRIPT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
    return 0
end
local run = cjson.decode(raw)
if run.state ~= 'running' or run.token == nil or int(run.token) ~= ARGV[2] then
    return 0
end
local now = now_ms()
if ARGV[4] == '1' then
    if (run.lease_until_ms or 0) > now then
        return 0
    end
    run.started_at_ms = now
end
run.lease_until_ms = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(run))
return 1
"""

# Record 'missed' or 'skipped' for a slot nobody acted on, closing it.
# KEYS[1] - claim key        {PJ}:slot:<slot_ms>
# KEYS[2] - history records  {PJ}:runs
# KEYS[3] - history index    {PJ}:index
# ARGV[1] - slot_ms
# ARGV[2] - state
# ARGV[3] - instance id (who recorded it)
# ARGV[4] - error ('' for none)
# ARGV[5] - history_size
# ARGV[6] - history_ttl_ms
# ARGV[7] - keep_until_ms (claim key set to 0 until then; none when past)
# return 1 when written, 0 when the slot already has a record or a claim
LUA_RECORD_SCRIPT = """
local slot = tonumber(ARGV[1])
local now = now_ms()
local guard = redis.call('GET', KEYS[1])
if (guard and tonumber(guard) >= 0) or redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
    return 0
end
local keep_until = tonumber(ARGV[7])
set_guard(KEYS[1], 0, keep_until, now)
local error = nil
if ARGV[4] ~= '' then
    error = ARGV[4]
end
put_run(KEYS[2], KEYS[3], ARGV[1], ARGV[1], {
    slot_ms = slot, state = ARGV[2], instance = ARGV[3], error = error,
    keep_until_ms = keep_until})
local ttl = tonumber(ARGV[6])
trim(KEYS[2], KEYS[3], tonumber(ARGV[5]), ttl, now)
keep_key_until(KEYS[2], math.max(slot + ttl, keep_until), now)
keep_key_until(KEYS[3], math.max(slot + ttl, keep_until), now)
return 1
"""

# Give back a claimed, unsent slot (hand-over), fenced by its token.
# KEYS[1] - claim key        {PJ}:slot:<slot_ms>
# KEYS[2] - history records  {PJ}:runs
# KEYS[3] - history index    {PJ}:index
# ARGV[1] - slot_ms
# ARGV[2] - fencing token (decimal string)
# return 1 when released (record removed, claim key set to -token so the
# next claim gets token + 1), 0 when the record is not 'claimed' with this
# token.
LUA_RELEASE_SCRIPT = """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then
    return 0
end
local run = cjson.decode(raw)
if run.state ~= 'claimed' or run.token == nil or int(run.token) ~= ARGV[2] then
    return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('SET', KEYS[1], -run.token, 'KEEPTTL')
end
return 1
"""

# Claim a manual run (run_now) once per key.
# KEYS[1] - manual key       {PJ}:manual:<key>
# KEYS[2] - history records  {PJ}:runs
# KEYS[3] - history index    {PJ}:index
# ARGV[1] - the manual key
# ARGV[2] - instance id (the owner)
# ARGV[3] - keep_until_ms (absolute epoch ms: PEXPIREAT of the manual key)
# ARGV[4] - lease_ms
# ARGV[5] - history_ttl_ms (the history keys' expiry; no trimming here)
# return {token, slot_ms}: token 1 when won with the run's slot (the server's
# now, moved off a whole second and past any slot that has a record, so it
# never takes a scheduled slot); token 0 when the key was used, with that
# run's slot.
LUA_MANUAL_SCRIPT = """
local now = now_ms()
local used = redis.call('GET', KEYS[1])
if used then
    return {0, tonumber(used)}
end
local slot = now
if slot % 1000 == 0 then
    slot = slot + 1
end
while redis.call('HEXISTS', KEYS[2], int(slot)) == 1 do
    slot = slot + 1
end
local keep_until = tonumber(ARGV[3])
redis.call('SET', KEYS[1], int(slot))
if keep_until <= now then
    redis.call('DEL', KEYS[1])
else
    redis.call('PEXPIREAT', KEYS[1], int(keep_until))
end
put_run(KEYS[2], KEYS[3], int(slot), int(slot), {
    slot_ms = slot, state = 'claimed', instance = ARGV[2], token = 1,
    claimed_at_ms = now, lease_until_ms = now + tonumber(ARGV[4]),
    keep_until_ms = keep_until, manual_key = ARGV[1]})
local until_ms = math.max(now + tonumber(ARGV[5]), keep_until)
keep_key_until(KEYS[2], until_ms, now)
keep_key_until(KEYS[3], until_ms, now)
return {1, slot}
"""

# Read a job's history, newest first.
# KEYS[1] - history records  {PJ}:runs
# KEYS[2] - history index    {PJ}:index
# ARGV[1] - most records to return (0 for all)
# return the JSON records, newest slot first
LUA_HISTORY_SCRIPT = """
local members = redis.call('ZREVRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)
local out = {}
for _, member in ipairs(members) do
    local raw = redis.call('HGET', KEYS[1], member)
    if raw then
        out[#out + 1] = raw
    end
end
return out
"""

# Whether a claim is still held (the scheduler's check before a late send).
# KEYS[1] - history records  {PJ}:runs
# ARGV[1] - slot_ms
# ARGV[2] - fencing token (decimal string)
# ARGV[3] - margin_ms
# return 1 when the slot's current record carries this token, is still
# 'claimed', and its lease ends more than margin_ms after the server's now;
# 0 otherwise. Reads only.
LUA_HOLDING_SCRIPT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
    return 0
end
local run = cjson.decode(raw)
if run.state ~= 'claimed' or run.token == nil or int(run.token) ~= ARGV[2] then
    return 0
end
if (run.lease_until_ms or 0) <= now_ms() + tonumber(ARGV[3]) then
    return 0
end
return 1
"""

# Add or refresh an instance in the registry; prune dead ones. The
# definitions live in the instance hash's own fields ('jobs', and the
# fingerprint they belong to in 'jobs_fingerprint'), written only when given.
# KEYS[1] - instance hash    {P}:instance:<id>
# KEYS[2] - registry index   {P}:instances
# ARGV[1] - instance id
# ARGV[2] - the InstanceInfo as JSON without its jobs (heartbeat_ms set here)
# ARGV[3] - ttl_ms
# ARGV[4] - the schedule fingerprint
# ARGV[5] - the definitions as JSON, or '' to keep the stored ones
# return {heartbeat (server now, epoch ms), 1 when the hash holds definitions
# for ARGV[4] else 0}
LUA_REGISTER_SCRIPT = """
local now = now_ms()
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'info', ARGV[2], 'heartbeat_ms', int(now))
if ARGV[5] ~= '' then
    redis.call('HSET', KEYS[1], 'jobs', ARGV[5], 'jobs_fingerprint', ARGV[4])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], int(now + ttl), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. int(now))
keep_key_until(KEYS[2], now + ttl, now)
local stored = 0
if redis.call('HGET', KEYS[1], 'jobs_fingerprint') == ARGV[4] then
    stored = 1
end
return {now, stored}
"""

# The newest scheduled slot with a record (manual runs left out).
# KEYS[1] - history records  {PJ}:runs
# KEYS[2] - history index    {PJ}:index
# return the slot (epoch ms), or -1 when none of the newest ten records is
# a scheduled run
LUA_LAST_SLOT_SCRIPT = """
for _, member in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, 9)) do
    local raw = redis.call('HGET', KEYS[1], member)
    if raw then
        local run = cjson.decode(raw)
        if not run.manual_key and run.slot_ms then
            return run.slot_ms
        end
    end
end
return -1
"""


@dataclass(frozen=True)
class _Script:
    """One Lua script: its name (for errors), full source and SHA1."""

    name: str
    source: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


def _script(name: str, body: str) -> _Script:
    return _Script(name, _LUA_HELPERS + body)


CLAIM = _script("claim", LUA_CLAIM_SCRIPT)
TAKE_OVER = _script("take_over", LUA_TAKE_OVER_SCRIPT)
MARK = _script("mark", LUA_MARK_SCRIPT)
EXTEND = _script("extend", LUA_EXTEND_SCRIPT)
RECORD = _script("record_if_absent", LUA_RECORD_SCRIPT)
RELEASE = _script("release", LUA_RELEASE_SCRIPT)
MANUAL = _script("claim_manual", LUA_MANUAL_SCRIPT)
HISTORY = _script("history", LUA_HISTORY_SCRIPT)
REGISTER = _script("register", LUA_REGISTER_SCRIPT)
LAST_SLOT = _script("last_slot", LUA_LAST_SLOT_SCRIPT)
HOLDING = _script("holding", LUA_HOLDING_SCRIPT)
SCRIPTS = (
    CLAIM,
    TAKE_OVER,
    MARK,
    EXTEND,
    RECORD,
    RELEASE,
    MANUAL,
    HISTORY,
    REGISTER,
    HOLDING,
    LAST_SLOT,
)

#: The history timestamp each state sets.
_STAMP = {
    State.SENT: "sent_at_ms",
    State.RUNNING: "started_at_ms",
    State.SUCCEEDED: "finished_at_ms",
    State.FAILED: "finished_at_ms",
    State.LOST: "finished_at_ms",
}

#: A client: a plain (or Sentinel-managed) Redis, or a cluster.
_Client = redis.Redis | RedisCluster

#: One scripted call: (script, keys, args).
_Call = tuple[_Script, Sequence[str], Sequence[Any]]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class RedisBackend(Backend):
    """Slots claimed in Redis, one Lua script per operation.

    Guarantees (Redis runs a script atomically, so no other command lands in
    between the checks and the writes of one script):

    * one winner per ``(job, slot)`` while the claim key lives:
      :data:`LUA_CLAIM_SCRIPT` wins only when the claim key
      ``{PJ}:slot:<slot_ms>`` holds no token and the slot has no history
      record; it writes both in the same script. The claim key expires at
      the request's ``keep_until_ms`` (``PEXPIREAT``, an absolute time), and
      history trimming skips a record until its ``keep_until_ms``;
    * the claim window and lease expiry are judged by the server's clock
      (``TIME`` inside the scripts; Redis replicates a script's effects, not
      the script, so replicas and the AOF see the same writes), never by the
      client's;
    * fencing: :data:`LUA_MARK_SCRIPT` and :data:`LUA_RELEASE_SCRIPT` write
      only when the slot's current record carries the caller's token;
      :data:`LUA_TAKE_OVER_SCRIPT` takes a ``claimed`` slot whose lease ran
      out by server time, with token ``old + 1``, leaving the old record in
      history as ``superseded``;
    * :data:`LUA_MANUAL_SCRIPT` wins once per ``(job, key)`` while the
      manual key lives (until ``keep_until_ms``);
    * nothing grows without bound: claim and manual keys expire; history is
      trimmed to ``history_size`` and ``history_ttl_ms`` inside the writing
      scripts, amortised: a job's history is trimmed back to
      ``history_size`` once it holds more than ``history_size`` plus a
      tenth (at least one record more), or a record older than
      ``history_ttl_ms``; the history keys themselves expire when their
      newest record would be trimmed by age (a claim moves their expiry in
      steps of a tenth of ``history_ttl_ms``, so they may live that much
      longer); registry entries expire after ``ttl_ms``.

    Needs Redis 6.2 or later (:meth:`open` checks). Limits (DESIGN section
    4): a Redis without persistence, or a Sentinel
    failover that loses unreplicated writes, can lose a claim, and then a slot
    can be claimed twice; AOF with ``appendfsync always`` and replicas narrow
    that window, they do not close it. An eviction policy other than
    ``noeviction`` with ``maxmemory`` set can evict claim keys: :meth:`open`
    refuses it unless ``allow_eviction`` (on a cluster, every primary is
    checked).

    Redis Cluster: every key of a job shares the hash tag ``{PJ}`` (the
    registry's share ``{P}``), so each script touches one cluster slot. Pass
    a ``redis.cluster.RedisCluster`` as the client (there is no cluster URL
    scheme); tested against a three-primary cluster without replicas, not
    through resharding or cluster failover. Every script touches only the
    keys it declares.

    A batch of claims goes out as one pipeline of ``EVALSHA`` calls (one
    round trip per node; after a ``NOSCRIPT``, one ``SCRIPT LOAD`` per
    missing script and a second pipeline for the calls that did not run).

    URLs: ``redis://[[user]:password@]host:6379/0``, ``rediss://`` (TLS,
    redis-py's ``ssl_*`` query parameters such as ``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` pass through),
    ``redis+sentinel://[:password@]host:26379[,host2:26379]/0`` and kombu's
    ``sentinel://host:26379;sentinel://host2:26379`` (both need
    ``master_name``; the client follows the master on failover through
    :meth:`redis.sentinel.Sentinel.master_for`; the password is the master's).

    Options (``anarchon_backend_options`` or URL query parameters):
        prefix: key prefix, default ``"anarchon:"``.
        socket_timeout: seconds to wait for connecting and for each reply,
            default 5.
        master_name: the Sentinel service name (Sentinel URLs only).
        allow_eviction: accept a Redis that may evict keys (the
            ``anarchon_allow_eviction`` setting), default False.
    """

    supports_leases: ClassVar[bool] = True
    options: ClassVar[frozenset[str]] = frozenset(
        {"prefix", "socket_timeout", "master_name", "allow_eviction"}
    )

    def __init__(
        self,
        url: str | None,
        *,
        client: redis.Redis | RedisCluster | None = None,
        instance: str,
        prefix: str = "anarchon:",
        socket_timeout: float | str = 5.0,
        master_name: str | None = None,
        allow_eviction: bool | str = False,
    ) -> None:
        """Build the backend without connecting.

        Args:
            url: the Redis URL; None when ``client`` is given.
            client: a ``redis.Redis`` (or ``redis.cluster.RedisCluster``)
                the user owns: used as is and never
                closed by :meth:`close`.
            instance: this scheduler's instance id (owner of its claims).
            prefix, socket_timeout, master_name, allow_eviction: see the
                class docstring.

        Raises:
            ConfigurationError: neither URL nor client, an unparsable URL, a
                Sentinel URL without ``master_name``, a bad option value.
        """
        if url is None and client is None:
            raise ConfigurationError("anarchon_backend: give a Redis URL or a redis.Redis client.")
        self.instance = instance
        self.prefix = str(prefix)
        self.socket_timeout = _seconds(socket_timeout)
        self.master_name = master_name or None
        self.allow_eviction = _flag("allow_eviction", allow_eviction)
        self._url = url
        self._owns_client = client is None
        self._client: _Client | None = client
        self._sentinel: Sentinel | None = None
        if client is None and url is not None:
            self._check_url(url)

    # -- lifecycle -----------------------------------------------------------

    def open(self) -> None:
        """Connect, check the eviction policy and load the scripts.

        Idempotent. Raises:
            BackendUnavailable: Redis cannot be reached in ``socket_timeout``.
            ConfigurationError: authentication is refused, Redis is older
                than 6.2, or ``maxmemory``
                is set with a policy other than ``noeviction`` and
                ``allow_eviction`` is off.
        """
        if self._client is None:
            self._client = self._connect()
        client = self._client
        try:
            self._check_version(client)
            self._check_eviction(client)
            self._load_scripts(client)
        except (AuthenticationError, AuthorizationError) as exc:
            raise ConfigurationError(
                f"anarchon_backend: Redis at {self.describe()} refused the credentials "
                f"({exc}); fix the user name or password in the URL."
            ) from exc
        except RedisError as exc:
            raise self._unavailable("open", exc) from exc
        logger.info("anarchon: Redis claim backend ready: %s", self.describe())

    def close(self) -> None:
        """Close the connections this backend opened; a user's client is left
        open. Safe to call twice."""
        client, self._client = self._client, None
        if not self._owns_client:
            self._client = client
            return
        if client is not None:
            client.close()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                sentinel.close()
            self._sentinel = None

    def describe(self) -> str:
        """``RedisBackend <url, password masked> prefix=...``."""
        where = _masked(self._url) if self._url else "(user's client)"
        return f"RedisBackend {where} prefix={self.prefix!r}"

    # -- claims --------------------------------------------------------------

    def now_ms(self) -> int:
        """The Redis server's clock (``TIME``), epoch ms.

        Raises:
            BackendUnavailable: no answer.
        """
        with self._translated("TIME"):
            seconds, micros = self._require_client().time()
        return int(seconds) * 1000 + int(micros) // 1000

    def claim(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim slots with :data:`LUA_CLAIM_SCRIPT`, all in one pipeline.

        Returns one :class:`Claim` per request, in order: won with the
        fencing token (1, or one more than a released claim's), lost with
        ``"taken"``, ``"window"`` (outside ``[server_now - window_before_ms,
        server_now + window_after_ms]``), or ``"unknown"`` when Redis
        answered that one script with an error (e.g. out of memory) while
        answering others.

        A script refused with ``WRONGTYPE`` (a key of the job holds another
        program's value) loses its request with ``"unknown"`` and is logged;
        it is not an outage, even when it is the whole batch, so the other
        jobs go on being claimed.

        Raises:
            BackendUnavailable: no answer, or every script failed (other
                than with ``WRONGTYPE``).
        """
        if not requests:
            return []
        calls = [self._slot_call(CLAIM, r) for r in requests]
        replies = self._run(calls)
        errors = [r for r in replies if isinstance(r, Exception)]
        if len(errors) == len(replies) and not all(map(_wrong_type, errors)):
            raise self._unavailable("claim", errors[0]) from errors[0]
        for request, reply in zip(requests, replies, strict=True):
            if isinstance(reply, Exception) and _wrong_type(reply):
                logger.error(
                    "anarchon: cannot claim %s: a key of this job (%s*) holds a value "
                    "that is not ours (%s); its slots are not sent until the key is "
                    "removed or anarchon_backend_options['prefix'] is changed",
                    request.job,
                    self._tag(request.job),
                    reply,
                )
        return [_claim_answer(r, reply) for r, reply in zip(requests, replies, strict=True)]

    def take_over(self, request: ClaimRequest) -> Claim:
        """Take over a slot whose winner's lease ran out, with
        :data:`LUA_TAKE_OVER_SCRIPT` (backup runner).

        Returns:
            a won :class:`Claim` with token ``old + 1`` when the slot's
            record is ``claimed`` (never marked sent) and its lease expired
            by the server's clock; the old record becomes ``superseded``.
            Otherwise lost with ``"held"`` (still ``claimed``, its lease
            still running), ``"taken"`` (already sent, or a manual run) or
            ``"window"``.
        Raises:
            BackendUnavailable: no answer.
        """
        reply = self._call(self._slot_call(TAKE_OVER, request))
        return _claim_answer(request, reply)

    def mark(
        self,
        claim: Claim,
        state: State,
        *,
        task_id: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Move a run to ``state`` with :data:`LUA_MARK_SCRIPT`, fenced by
        ``claim.token``; the state's timestamp is the server's now.

        A state only moves forward (``claimed`` < ``sent`` < ``running``
        < ``succeeded``/``failed``/``lost``), so ``mark(claim, RUNNING)`` is
        the worker's start gate: True once, False for a duplicate delivery.
        A late ``sent`` after the worker's ``succeeded`` records
        ``sent_at_ms`` and keeps ``succeeded``. Empty ``task_id``/``error``
        strings count as not given.

        Returns:
            False when the slot's current record does not carry the token
            (taken over, released, trimmed away, or ``claim.token`` is None),
            or the move is not forward; nothing is written then.
        Raises:
            BackendUnavailable: no answer.
        """
        if claim.token is None:
            return False
        return bool(self._call(self._mark_call(claim, State(state), task_id, error)))

    def mark_many(
        self,
        claims: Sequence[Claim],
        state: State,
        *,
        task_ids: Sequence[str | None] | None = None,
    ) -> list[bool]:
        """:meth:`mark` for many claims: one pipeline of
        :data:`LUA_MARK_SCRIPT` calls, each fenced by its claim's token.

        Returns:
            one answer per claim, in order (see :meth:`mark`).
        Raises:
            ValueError: ``task_ids`` is not as long as ``claims``.
            BackendUnavailable: no answer, or Redis answered any of the
                scripts with an error (the whole call may be sent again).
        """
        ids = [None] * len(claims) if task_ids is None else list(task_ids)
        if len(ids) != len(claims):
            raise ValueError(f"{len(ids)} task ids for {len(claims)} claims")
        state = State(state)
        marked = [
            (i, self._mark_call(claim, state, task_id, None))
            for i, (claim, task_id) in enumerate(zip(claims, ids, strict=True))
            if claim.token is not None
        ]
        answers = [False] * len(claims)
        if not marked:
            return answers
        replies = self._run([call for _, call in marked])
        for (i, _), reply in zip(marked, replies, strict=True):
            if isinstance(reply, Exception):
                raise self._unavailable("mark", reply) from reply
            answers[i] = bool(reply)
        return answers

    def _mark_call(
        self, claim: Claim, state: State, task_id: str | None, error: str | None
    ) -> _Call:
        args = [
            claim.slot_ms,
            str(claim.token),
            state.value,
            _STAMP.get(state, ""),
            task_id or "",
            error or "",
        ]
        return (MARK, [self._runs_key(claim.job)], args)

    def take_over_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """:meth:`take_over` for many slots: one pipeline of
        :data:`LUA_TAKE_OVER_SCRIPT` calls (a slot already sent answers 0
        after one ``HGET``).

        Returns:
            one :class:`Claim` per request, in order; ``"unknown"`` for a
            script Redis answered with an error while answering others.
        Raises:
            BackendUnavailable: no answer, or every script failed.
        """
        if not requests:
            return []
        replies = self._run([self._slot_call(TAKE_OVER, r) for r in requests])
        errors = [r for r in replies if isinstance(r, Exception)]
        if len(errors) == len(replies):
            raise self._unavailable("take_over", errors[0]) from errors[0]
        return [_claim_answer(r, reply) for r, reply in zip(requests, replies, strict=True)]

    def holding(self, claims: Sequence[Claim], margin_ms: int = 0) -> list[bool]:
        """Whether each claim is still held, with one pipeline of
        :data:`LUA_HOLDING_SCRIPT` calls (reads only; the lease judged by the
        server's clock).

        Returns:
            one answer per claim, in order (see :meth:`Backend.holding`).
        Raises:
            BackendUnavailable: no answer, or an error reply.
        """
        asked = [(i, c) for i, c in enumerate(claims) if c.won and c.token is not None]
        answers = [False] * len(claims)
        if not asked:
            return answers
        calls = [
            (HOLDING, [self._runs_key(c.job)], [c.slot_ms, str(c.token), int(margin_ms)])
            for _, c in asked
        ]
        for (i, _), reply in zip(asked, self._run(calls), strict=True):
            if isinstance(reply, Exception):
                raise self._unavailable("holding", reply) from reply
            answers[i] = bool(reply)
        return answers

    def extend(self, claim: Claim, lease_ms: int, *, restart: bool = False) -> bool:
        """Extend a running run's lease to the server's now plus ``lease_ms``
        (milliseconds), or restart it once its lease expired, with
        :data:`LUA_EXTEND_SCRIPT`, fenced by ``claim.token``
        (see :meth:`Backend.extend`).

        Raises:
            BackendUnavailable: no answer.
        """
        if claim.token is None:
            return False
        args = [claim.slot_ms, str(claim.token), int(lease_ms), "1" if restart else ""]
        return bool(self._call((EXTEND, [self._runs_key(claim.job)], args)))

    def record_if_absent(
        self,
        job: str,
        slot_ms: int,
        state: State,
        *,
        error: str | None = None,
        history_size: int = 100,
        history_ttl_ms: int = DEFAULT_HISTORY_TTL_MS,
        keep_until_ms: int = 0,
    ) -> bool:
        """Record ``missed`` or ``skipped`` with :data:`LUA_RECORD_SCRIPT`
        for a slot that has neither a claim nor a record; the claim key is
        then set to 0 until ``keep_until_ms`` (when that is ahead), which
        closes the slot.

        Returns:
            True when written; False when the slot already had one.
        Raises:
            BackendUnavailable: no answer.
        """
        record = AbsentRecord(
            job, slot_ms, State(state), error, history_size, history_ttl_ms, keep_until_ms
        )
        return bool(self._call(self._record_call(record)))

    def record_many_if_absent(self, records: Sequence[AbsentRecord]) -> list[bool]:
        """:meth:`record_if_absent` for many slots: one pipeline of
        :data:`LUA_RECORD_SCRIPT` calls.

        Returns:
            one answer per record, in order.
        Raises:
            BackendUnavailable: no answer, or Redis answered any of the
                scripts with an error (the others may be written).
        """
        if not records:
            return []
        replies = self._run([self._record_call(r) for r in records])
        for reply in replies:
            if isinstance(reply, Exception):
                raise self._unavailable("record", reply) from reply
        return [bool(reply) for reply in replies]

    def _record_call(self, r: AbsentRecord) -> _Call:
        args = [
            r.slot_ms,
            State(r.state).value,
            self.instance,
            r.error or "",
            r.history_size,
            r.history_ttl_ms,
            r.keep_until_ms,
        ]
        return (RECORD, self._slot_keys(r.job, r.slot_ms), args)

    def release(self, claims: Sequence[Claim]) -> None:
        """Give back won, unsent claims with :data:`LUA_RELEASE_SCRIPT`, all
        in one pipeline. Only a record still ``claimed`` with the claim's
        token is released; its slot can be claimed again at once (the next
        winner gets token + 1).

        Raises:
            BackendUnavailable: no answer.
        """
        calls: list[_Call] = [
            (RELEASE, self._slot_keys(c.job, c.slot_ms), [c.slot_ms, str(c.token)])
            for c in claims
            if c.won and c.token is not None
        ]
        if calls:
            self._run(calls)

    def claim_manual(self, job: str, key: str, keep_until_ms: int) -> Claim:
        """Claim a manual run with :data:`LUA_MANUAL_SCRIPT`: the first call
        per ``(job, key)`` wins (token 1) until ``keep_until_ms``.

        The run's ``slot_ms`` is the server's now, moved forward by a
        millisecond when it falls on a whole second or on a slot that has a
        record, so a manual run never takes a scheduled slot. A lost call
        answers with the winning run's slot.

        Raises:
            BackendUnavailable: no answer.
        """
        tag = self._tag(job)
        keys = [f"{tag}:manual:{key}", f"{tag}:runs", f"{tag}:index"]
        args = [key, self.instance, keep_until_ms, MANUAL_LEASE_MS, DEFAULT_HISTORY_TTL_MS]
        token, slot_ms = self._call((MANUAL, keys, args))
        if int(token):
            return Claim(job, int(slot_ms), won=True, token=int(token))
        return Claim(job, int(slot_ms), won=False, reason="taken")

    # -- history -------------------------------------------------------------

    def history(self, job: str, limit: int | None = None) -> list[RunRecord]:
        """The job's records, newest slot first (for one slot, the current
        record before superseded ones), at most ``limit``; read with
        :data:`LUA_HISTORY_SCRIPT`.

        A record that is not ours (not JSON, no slot, or a state this
        version does not know) is left out with a warning; its slot stays
        taken, since claims check the slot's key, not the record.

        Raises:
            BackendUnavailable: no answer.
        """
        if limit is not None and limit <= 0:
            return []
        tag = self._tag(job)
        raw = self._call((HISTORY, [f"{tag}:runs", f"{tag}:index"], [limit or 0]))
        return [record for record in (_record_or_none(job, item) for item in raw) if record]

    def last_slots(self, jobs: Sequence[str]) -> dict[str, int]:
        """``job -> newest scheduled slot with a record`` for each of
        ``jobs`` that has one: :data:`LUA_LAST_SLOT_SCRIPT` per job, in
        pipelines of :data:`LAST_SLOTS_CHUNK` calls (see
        :meth:`Backend.last_slots`).

        Raises:
            BackendUnavailable: no answer, or an error reply.
        """
        names = list(jobs)
        found: dict[str, int] = {}
        for start in range(0, len(names), LAST_SLOTS_CHUNK):
            chunk = names[start : start + LAST_SLOTS_CHUNK]
            calls: list[_Call] = [
                (LAST_SLOT, [self._runs_key(job), f"{self._tag(job)}:index"], []) for job in chunk
            ]
            for job, reply in zip(chunk, self._run(calls), strict=True):
                if isinstance(reply, Exception):
                    raise self._unavailable("last_slots", reply) from reply
                if int(reply) >= 0:
                    found[job] = int(reply)
        return found

    # -- instance registry ---------------------------------------------------

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

    # -- keys ----------------------------------------------------------------

    def _tag(self, job: str) -> str:
        return "{" + self.prefix + job + "}"

    def _runs_key(self, job: str) -> str:
        return f"{self._tag(job)}:runs"

    def _slot_keys(self, job: str, slot_ms: int) -> list[str]:
        tag = self._tag(job)
        return [f"{tag}:slot:{slot_ms}", f"{tag}:runs", f"{tag}:index"]

    def _registry_key(self) -> str:
        return "{" + self.prefix + "}:instances"

    def _instance_key(self, instance: str) -> str:
        return "{" + self.prefix + "}:instance:" + instance

    def _slot_call(self, script: _Script, r: ClaimRequest) -> _Call:
        args = [
            r.slot_ms,
            self.instance,
            r.window_before_ms,
            r.window_after_ms,
            r.keep_until_ms,
            r.lease_ms,
            r.history_size,
            r.history_ttl_ms,
        ]
        return (script, self._slot_keys(r.job, r.slot_ms), args)

    # -- running scripts -----------------------------------------------------

    def _call(self, call: _Call) -> Any:
        """Run one script; its error reply raises BackendUnavailable."""
        [reply] = self._run([call])
        if isinstance(reply, Exception):
            raise self._unavailable(call[0].name, reply) from reply
        return reply

    def _run(self, calls: Sequence[_Call]) -> list[Any]:
        """Run scripts in one pipeline (``EVALSHA``, no transaction; a single
        call without one) and return their replies in order, an error reply
        as its exception.
        Scripts Redis lost (``NOSCRIPT``, e.g. after a restart) are loaded
        and those calls run again: they did not run the first time."""
        client = self._require_client()
        with self._translated(calls[0][0].name):
            replies = _pipeline(client, calls)
            again = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if again:
                self._load_scripts(client, {calls[i][0] for i in again})
                for i, reply in zip(
                    again, _pipeline(client, [calls[i] for i in again]), strict=True
                ):
                    replies[i] = reply
        return replies

    def _load_scripts(self, client: _Client, scripts: Iterable[_Script] = SCRIPTS) -> None:
        # One call per script, not a pipeline: a cluster client refuses to
        # pipeline SCRIPT LOAD, and sends each to every primary.
        for script in scripts:
            client.script_load(script.source)

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        try:
            yield
        except RedisError as exc:
            raise self._unavailable(what, exc) from exc

    def _unavailable(self, what: str, exc: BaseException) -> BackendUnavailable:
        return BackendUnavailable(f"Redis {what} failed on {self.describe()}: {exc}")

    def _require_client(self) -> _Client:
        if self._client is None:
            self.open()
        assert self._client is not None
        return self._client

    # -- connecting ----------------------------------------------------------

    def _check_url(self, url: str) -> None:
        if _is_sentinel(url):
            if not self.master_name:
                raise ConfigurationError(
                    f"anarchon_backend {_masked(url)!r}: a Sentinel URL needs the "
                    "master_name option (anarchon_backend_options={'master_name': "
                    "'mymaster'} or ?master_name=mymaster)."
                )
            _sentinel_parts(url)
            return
        try:
            # Builds a connection object (no socket) so that a query
            # parameter redis-py does not know fails here, not in a tick.
            pool = redis.ConnectionPool.from_url(url)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"anarchon_backend {_masked(url)!r}: {exc}.") from exc
        self._refuse_unknown_query(url, _connection_arguments(pool))
        try:
            pool.connection_class(**pool.connection_kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"anarchon_backend {_masked(url)!r}: {exc}. Query parameters other than "
                f"{', '.join(sorted(self.options))} go to redis-py's connection as is."
            ) from exc

    def _refuse_unknown_query(self, url: str, accepted: frozenset[str]) -> None:
        """Refuse URL query parameters that are neither this backend's
        options nor redis-py connection arguments, with a "did you mean"."""
        names = {key for key, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
        unknown = sorted(names - accepted - self.options)
        if not unknown:
            return
        close = difflib.get_close_matches(unknown[0], sorted(accepted | self.options), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(
            f"anarchon_backend {_masked(url)!r}: unknown URL query parameter(s) "
            f"{', '.join(unknown)}.{hint} The query takes this backend's options "
            f"({', '.join(sorted(self.options))}) and redis-py's connection arguments "
            "(socket_connect_timeout, health_check_interval, ssl_ca_certs, ...)."
        )

    def _connect(self) -> redis.Redis:
        assert self._url is not None
        timeouts: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "retry": _one_reconnect(),
            "decode_responses": True,
        }
        if not _is_sentinel(self._url):
            return redis.Redis.from_url(self._url, **timeouts)
        hosts, db, username, password = _sentinel_parts(self._url)
        self._sentinel = Sentinel(
            hosts,
            sentinel_kwargs={
                "socket_timeout": self.socket_timeout,
                "socket_connect_timeout": self.socket_timeout,
                "retry": _one_reconnect(),
            },
        )
        assert self.master_name is not None
        client: redis.Redis = self._sentinel.master_for(
            self.master_name, db=db, username=username, password=password, **timeouts
        )
        return client

    def _check_version(self, client: _Client) -> None:
        """Refuse a Redis older than 6.2 (the scripts use ``SET .. PXAT``)."""
        if isinstance(client, RedisCluster):
            return  # redis-py answers INFO per node there; cluster needs 7 anyway
        version = str(client.info("server").get("redis_version", "0"))
        if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < MIN_REDIS:
            raise ConfigurationError(
                f"anarchon_backend: Redis at {self.describe()} is version {version}; "
                "the claim scripts need Redis 6.2 or later."
            )

    def _check_eviction(self, client: _Client) -> None:
        """Refuse a Redis that may evict claim keys (see class docstring);
        with a cluster client, every primary is checked."""
        try:
            configs = _memory_configs(client)
        except (AuthenticationError, AuthorizationError, redis.ConnectionError):
            raise
        except ResponseError as exc:
            logger.warning(
                "anarchon: could not verify the eviction policy of %s (CONFIG GET "
                "refused: %s). If maxmemory is set with a policy other than "
                "noeviction, Redis can evict claim keys and a slot can run twice.",
                self.describe(),
                exc,
            )
            return
        for where, config in configs:
            self._refuse_eviction(where, config)

    def _refuse_eviction(self, where: str, config: dict[str, Any]) -> None:
        maxmemory = int(config.get("maxmemory") or 0)
        policy = config.get("maxmemory-policy")
        if maxmemory == 0 or policy in (None, "noeviction"):
            return
        node = f" (node {where})" if where else ""
        message = (
            f"Redis at {self.describe()}{node} has maxmemory {maxmemory} with "
            f"maxmemory-policy {policy}: it can evict claim keys ('volatile-*' "
            "policies evict exactly the keys that have an expiry, as claim keys do), "
            "and an evicted claim lets a second instance run the same slot."
        )
        if not self.allow_eviction:
            raise ConfigurationError(
                f"{message} Set maxmemory-policy noeviction (or use a Redis of its own), "
                "or accept duplicates with anarchon_allow_eviction = True."
            )
        logger.warning("anarchon: %s Accepted because anarchon_allow_eviction is set.", message)


# -- helpers -----------------------------------------------------------------


def _memory_configs(client: _Client) -> list[tuple[str, dict[str, Any]]]:
    """``CONFIG GET maxmemory*`` of the server (named ``""``), or of every
    cluster primary (named ``host:port``)."""
    if isinstance(client, RedisCluster):
        nodes = client.config_get("maxmemory*", target_nodes=RedisCluster.PRIMARIES)
        return list(cast("dict[str, dict[str, Any]]", nodes).items())
    return [("", cast("dict[str, Any]", client.config_get("maxmemory*")))]


def _pipeline(client: _Client, calls: Sequence[_Call]) -> list[Any]:
    """The calls' replies, an error reply as its exception. One call goes
    out as a plain command: a pipeline object costs a single claim about a
    third of its client time."""
    if len(calls) == 1:
        script, keys, args = calls[0]
        try:
            return [client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)]
        except ResponseError as exc:  # an error reply (NOSCRIPT, OOM, ...), as a pipeline gives it
            return [exc]
    with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            # execute_command, not evalsha(): a cluster pipeline blocks the
            # latter but routes EVALSHA by its first key.
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        replies: list[Any] = pipe.execute(raise_on_error=False)
    return replies


def _wrong_type(error: Exception) -> bool:
    """True for Redis's ``WRONGTYPE`` reply: one key holds a value of another
    kind (not ours), a fault of that key, not of the server."""
    return isinstance(error, ResponseError) and "WRONGTYPE" in str(error)


def _claim_answer(request: ClaimRequest, reply: Any) -> Claim:
    if isinstance(reply, Exception):
        return Claim(request.job, request.slot_ms, won=False, reason="unknown")
    token = int(reply)
    if token > 0:
        return Claim(request.job, request.slot_ms, won=True, token=token)
    reason = {-1: "window", -2: "held"}.get(token, "taken")
    return Claim(request.job, request.slot_ms, won=False, reason=reason)


def _record_or_none(job: str, item: str | bytes) -> RunRecord | None:
    """The history record stored as ``item`` (JSON), or None (logged) when
    it cannot be read as one."""
    try:
        return _record(job, json.loads(item))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning(
            "anarchon: history of %s: a record that is not ours (%s: %.200r); left out",
            job,
            type(exc).__name__,
            item,
        )
        return None


def _record(job: str, run: dict[str, Any]) -> RunRecord:
    def ms(name: str) -> int | None:
        value = run.get(name)
        return None if value is None else int(value)

    token = run.get("token")
    return RunRecord(
        job=job,
        slot_ms=int(run["slot_ms"]),
        state=State(run["state"]),
        instance=run.get("instance"),
        token=None if token is None else int(token),
        claimed_at_ms=ms("claimed_at_ms"),
        sent_at_ms=ms("sent_at_ms"),
        started_at_ms=ms("started_at_ms"),
        finished_at_ms=ms("finished_at_ms"),
        task_id=run.get("task_id"),
        error=run.get("error"),
        manual_key=run.get("manual_key"),
        lease_until_ms=ms("lease_until_ms"),
    )


def _instance(info: str | bytes, heartbeat_ms: str | bytes) -> InstanceInfo:
    fields = json.loads(info)
    return InstanceInfo.from_dict({**fields, "heartbeat_ms": int(heartbeat_ms)})


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _one_reconnect() -> Retry:
    """Retry once, at once, on a connection error, never on a timeout.

    redis-py's pool already replaces a connection the server closed before
    it is used; this covers one that breaks while in use. A server that is
    down still fails fast (two refused connects), and a frozen one after one
    ``socket_timeout``. Re-running a script whose reply was lost is safe: a
    claim then answers ``taken`` (lost, never a duplicate)."""
    return Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))


def _seconds(value: float | str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds <= 0:
        raise ConfigurationError(
            f"anarchon_backend_options: socket_timeout must be a positive number of "
            f"seconds, got {value!r}."
        )
    return seconds


def _flag(name: str, value: bool | str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ConfigurationError(
        f"anarchon_backend_options: {name} must be true or false, got {value!r}."
    )


def _is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme.lower() in {"sentinel", "redis+sentinel"}


def _sentinel_parts(url: str) -> tuple[list[tuple[str, int]], int, str | None, str | None]:
    """Sentinel hosts, db, user name and password from a Sentinel URL.

    Accepts ``redis+sentinel://[:pw@]h1:26379,h2:26379/0`` and kombu's
    ``sentinel://[:pw@]h1:26379/0;sentinel://h2:26379``; credentials and db
    come from the first part that has them.

    Raises:
        ConfigurationError: a part without a host, or a bad port or db.
    """
    hosts: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    try:
        for part in url.split(";"):
            split = urlsplit(part.strip())
            userinfo, _, hostlist = split.netloc.rpartition("@")
            if userinfo and password is None:
                user, _, secret = userinfo.partition(":")
                username, password = unquote(user) or None, unquote(secret) or None
            path = split.path.strip("/")
            if path and db == 0:
                db = int(path)
            for host in hostlist.split(","):
                one = urlsplit("//" + host)
                if not one.hostname:
                    raise ValueError(f"no host in {host!r}")
                hosts.append((one.hostname, one.port or SENTINEL_PORT))
    except ValueError as exc:
        raise ConfigurationError(
            f"anarchon_backend {_masked(url)!r}: not a Sentinel URL ({exc}); use "
            "redis+sentinel://host:26379,host2:26379/0 or "
            "sentinel://host:26379;sentinel://host2:26379."
        ) from exc
    return hosts, db, username, password


_PASSWORD = re.compile(r"(//[^:@/;,]*:)[^@/;]*@")


def _connection_arguments(pool: redis.ConnectionPool) -> frozenset[str]:
    """The keyword arguments ``pool`` passes its connections can take (and
    the pool's own, such as ``max_connections``): the names redis-py accepts
    as URL query parameters."""
    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for cls in (*pool.connection_class.__mro__, type(pool)):
        init = cls.__dict__.get("__init__")
        if init is None or init is object.__init__:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a C-level __init__: nothing to read
            continue
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(names - {"self", "connection_class"})


def _masked(url: str) -> str:
    """``url`` with every password masked, also in multi-host Sentinel URLs
    and malformed ones, which kombu's sanitizer cannot parse."""
    if not _is_sentinel(url):
        try:
            return sanitize_url(url)
        except ValueError:
            pass
    return _PASSWORD.sub(r"\1**@", url)
