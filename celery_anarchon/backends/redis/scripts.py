"""The Lua scripts of the Redis backend, one per operation, as module constants.

Each script's comment block names its KEYS, ARGV and return value; the helpers
in :data:`_LUA_HELPERS` are prepended to every script. Redis runs a script
atomically: no other command lands between its checks and its writes."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..base import FINAL_RANK, State

#: :attr:`State.rank` of the states a mark moves through, as a Lua table.
_LUA_RANKS = "{" + ", ".join(f"{s.value} = {s.rank}" for s in State if s.rank < FINAL_RANK) + "}"

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
#   past_deadline(now, deadline)   whether a request's deadline (server
#       time, epoch ms; 0 or '' for none) has passed
#   fenced_run(runs, slot, state, token)   the decoded record of a slot when
#       it is in state with this fencing token, else nil
_LUA_HELPERS = """
local function now_ms()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(x)
    return string.format('%d', x)
end

local function fenced_run(runs, slot, state, token)
    -- The record at `slot` in `runs`, decoded, when it is in `state` with
    -- fencing token `token` (a decimal string); nil otherwise.
    local raw = redis.call('HGET', runs, slot)
    if not raw then
        return nil
    end
    local run = cjson.decode(raw)
    if run.state ~= state or run.token == nil or int(run.token) ~= token then
        return nil
    end
    return run
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

local function past_deadline(now, deadline)
    deadline = tonumber(deadline) or 0
    return deadline > 0 and now > deadline
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
# ARGV[9] - deadline_ms (server time, epoch ms; 0 for none)
# return the fencing token (>= 1) when won, 0 when taken (claim key holds a
# token or a closing 0, or a record exists), -1 when outside the window,
# -3 when the server's now is past the deadline (the request came too late:
# its client may have given up on it; nothing is written)
LUA_CLAIM_SCRIPT = """
local slot = tonumber(ARGV[1])
local now = now_ms()
if past_deadline(now, ARGV[9]) then
    return -3
end
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
# ARGV[1..9] - as for LUA_CLAIM_SCRIPT
# return -3 past the deadline (as LUA_CLAIM_SCRIPT), the new fencing token
# (old + 1) when taken over, -2 when the slot
# is a scheduled run still 'claimed' whose lease has not ended yet (its
# holder may still send it: check again at the lease's end), 0 when it is
# not 'claimed' (sent, or further) or a manual run, -1 when outside the
# window. The old record stays in history as 'superseded'. A
# slot with no record and no live claim (never claimed, or released on
# hand-over) is claimed as by LUA_CLAIM_SCRIPT.
LUA_TAKE_OVER_SCRIPT = """
local slot = tonumber(ARGV[1])
local now = now_ms()
if past_deadline(now, ARGV[9]) then
    return -3
end
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
# The ranks are State.rank (base.py), rendered into the script below.
LUA_MARK_SCRIPT = f"""
local RANK = {_LUA_RANKS}
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
    return 0
end
local run = cjson.decode(raw)
if run.state == 'superseded' or run.token == nil or int(run.token) ~= ARGV[2] then
    return 0
end
local from, to = RANK[run.state] or {FINAL_RANK}, RANK[ARGV[3]] or {FINAL_RANK}
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
local run = fenced_run(KEYS[1], ARGV[1], 'running', ARGV[2])
if not run then
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
local run = fenced_run(KEYS[2], ARGV[1], 'claimed', ARGV[2])
if not run then
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
local run = fenced_run(KEYS[1], ARGV[1], 'claimed', ARGV[2])
if not run then
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

# LUA_CLAIM_SCRIPT for a job with a run limit: KEYS[4] is the job's count of
# won claims ({PJ}:won, kept for good), ARGV[10] the limit; the claim wins
# only below it, and counts the win in the same script. Returns -4 when the
# count reached the limit ("finished").
# A slot claimed again after its claim was released (its guard holds the
# released token, negated) was counted when first won: it is not counted,
# nor refused, again.
LUA_CLAIM_COUNTED_SCRIPT = LUA_CLAIM_SCRIPT.replace(
    "local token = 1\n",
    "if not guard and tonumber(redis.call('GET', KEYS[4]) or '0') >= tonumber(ARGV[10]) then\n"
    "    return -4\n"
    "end\n"
    "local token = 1\n",
    1,
).replace("return token\n", "if not guard then redis.call('INCR', KEYS[4]) end\nreturn token\n", 1)
assert LUA_CLAIM_COUNTED_SCRIPT.count("KEYS[4]") == 2

CLAIM_COUNTED = _script("claim_counted", LUA_CLAIM_COUNTED_SCRIPT)


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
    CLAIM_COUNTED,
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


#: One scripted call: (script, keys, args).
_Call = tuple[_Script, Sequence[str], Sequence[Any]]
