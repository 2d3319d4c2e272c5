"""The Lua scripts: one per operation on a resource's keys, each with a KEYS/ARGV/Returns header.

Each script is atomic on the Redis server, touches only keys passed in KEYS (all sharing the
resource's hash tag, so they are Redis-Cluster-safe) and reads the server clock with ``TIME``.
Redis >= 5 replicates script *effects*, so calling ``TIME`` before a write is allowed. They are
run, and their replies given meaning, by :mod:`django_joblock.lua`.

Waiting in line (WAIT, LEAVE, and RELEASE's hand-over; the protocol is told in
:mod:`django_joblock.waiting`): a busy lock's waiters hold *tickets*, a sorted set in arrival
order plus a hash of each ticket's expiry (server ms) and the details its lock is written with.
A ticket whose waiter stopped refreshing it is dropped by the next script that finds it first
in line. While live tickets wait, a free lock is theirs: ACQUIRE refuses newcomers, and RELEASE
hands the lock straight to the first live ticket.
"""

from __future__ import annotations

from . import conf

# Last fence of a resource lives this long after its last acquire. The fence is also floored by
# the server clock, so a forgotten counter cannot make the next fence go backwards.
FENCE_COUNTER_TTL_MS = 86_400_000

# Largest TTL a script accepts (ms): the longest the settings and arguments allow.
MAX_TTL_MS = int(conf.MAX_TTL * 1000)


# Redis does not roll back a script's writes when a later command in it fails, so every script
# that writes checks its numeric arguments *first*: a bad TTL must fail before the lock hash is
# written, never between HSET and PEXPIRE (which would leave a lock that never expires).
def _check_ms(name: str, variable: str, argument: str) -> str:
    """Lua that returns an error unless ``argument`` is an integer count of ms in range."""
    return (
        f"""
local {variable} = tonumber({argument})
if not {variable} or {variable} ~= math.floor({variable}) or {variable} < 1
    or {variable} > MAX_TTL_MS then
  return redis.error_reply('ERR joblock: {name} in ms must be an integer in 1..MAX_TTL_MS, got '
    .. tostring({argument}))
end
"""
    ).replace("MAX_TTL_MS", str(MAX_TTL_MS))


_CHECK_TTL = _check_ms("ttl", "ttl_ms", "ARGV[2]")

# The first live ticket in line and its packed details (nil: nobody in line; '' when more than
# 100 dead tickets were removed and the line is not known yet). Tickets found expired on the way
# (their waiter gave up, died or stopped too long) leave the line.
_FIRST_LIVE = """
local function first_live(now_ms)
  for _ = 1, 100 do
    local head = redis.call('ZRANGE', QUEUE, 0, 0)[1]
    if not head then return nil, nil end
    local data = redis.call('HGET', TICKETS, head)
    if data and cmsgpack.unpack(data) > now_ms then return head, data end
    redis.call('ZREM', QUEUE, head)
    redis.call('HDEL', TICKETS, head)
  end
  return '', nil
end
"""

# Someone waits: the first ticket in line (or ''), and the lock hash (KEYS[1]) says so with its
# ``waiters`` field, which spares an uncontended release a look at the line.
_FLAG_WAITERS = """
local function flag_waiters()
  local first = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  if not first then return '' end
  redis.call('HSET', KEYS[1], 'waiters', 1)
  return first
end
"""

# Write the lock (KEYS[1]) for ``token`` with a new fence (KEYS[2]; ``t`` is a TIME reply);
# returns the fence. fence = max(counter + 1, server time in microseconds): strictly increasing
# per resource even after the counter is lost (expiry, eviction, FLUSHDB, restart without
# persistence), as long as the Redis server clock does not step backwards.
_GRANT = """
local function grant(t, token, ttl, fence_ttl, host, pid, job_id, job_func, worker)
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local fence_s = string.format('%d', now_us)
  -- Common case in one call: store the clock and read the old counter (SET ... GET, 6.2+).
  local last = tonumber(redis.call('SET', KEYS[2], fence_s, 'PX', fence_ttl, 'GET') or '0')
  local fence = now_us
  if last >= now_us then
    -- More than one acquisition within a microsecond, or the clock is behind the counter.
    fence = last + 1
    fence_s = string.format('%d', fence)
    redis.call('SET', KEYS[2], fence_s, 'PX', fence_ttl)
  end
  redis.call('HSET', KEYS[1], 'token', token, 'fence', fence_s, 'ttl_ms', ttl,
    'host', host, 'pid', pid, 'job_id', job_id, 'job_func', job_func, 'worker', worker,
    'acquired_ms', now_ms, 'renewed_ms', now_ms, 'renewals', 0)
  redis.call('PEXPIRE', KEYS[1], ttl)
  return fence
end
"""

_NOW_MS = "tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"


def _line(snippet: str, queue: str, tickets: str) -> str:
    return snippet.replace("QUEUE", queue).replace("TICKETS", tickets)


ACQUIRE = (
    (
        """
-- Acquire a lock if free (one try).
-- KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] wait queue, KEYS[4] tickets (one hash
-- tag; 3 and 4 may be left out, and then waiters in line are not respected)
-- ARGV[1] owner token, ARGV[2] ttl in ms (integer, 1..MAX_TTL_MS), ARGV[3] fence counter ttl
-- in ms, ARGV[4] host, ARGV[5] pid, ARGV[6] RQ job id, ARGV[7] job function, ARGV[8] worker
-- Returns the fence (> 0) when acquired; when busy, -1 - (holder's PTTL in ms), i.e. <= -1
-- (-1 also when the lock is free but live tickets wait for it: a newcomer never goes before
-- them); an error (nothing written) when the ttl is not a valid integer.
-- (One integer rather than an array: the cheapest reply to parse on the hot path.)
-- Already ours (an earlier call with this token ran but its reply was lost): the same fence
-- again, and the TTL set afresh, so that retrying an acquire is safe.
"""
        + _CHECK_TTL
        + _GRANT
        + _line(_FIRST_LIVE, "KEYS[3]", "KEYS[4]")
        + """
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  local held = redis.call('HMGET', KEYS[1], 'token', 'fence')
  if held[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    return tonumber(held[2])
  end
  if pttl == -1 then
    -- A lock without expiry can only be left by a bug (or a hand-made key): give it one, so
    -- that it cannot block the resource forever.
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    pttl = ttl_ms
  end
  return -1 - math.max(pttl, 0)
end
local t = redis.call('TIME')
if KEYS[4] and redis.call('EXISTS', KEYS[3]) == 1 and first_live(NOW_MS) ~= nil then
  return -1
end
return grant(t, ARGV[1], ttl_ms, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
"""
    )
    .replace("MAX_TTL_MS", str(MAX_TTL_MS))
    .replace("NOW_MS", _NOW_MS)
)

WAIT = (
    (
        """
-- Wait in line for a lock: take the lock if it is free and nobody live is ahead; else take
-- or refresh this waiter's ticket (see django_joblock/waiting.py).
-- KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] wait queue (ZSET ticket -> arrival
-- order), KEYS[4] tickets (HASH ticket -> packed expiry and lock details), KEYS[5] this
-- ticket's wake list (LIST); all under the resource's hash tag
-- ARGV[1..8] as ACQUIRE, ARGV[9] ticket, ARGV[10] ticket ttl in ms, ARGV[11] ttl in ms of a
-- lock handed over to this ticket by a release (both integers, 1..MAX_TTL_MS), ARGV[12] '1'
-- for the last try (leave the line when not acquired), else '0'
-- Returns {fence, 0, first ticket in line or ''} when acquired (also when it already was
-- ours, handed over or a retry: then with the TTL set afresh); {0, holder's PTTL in ms (0:
-- free but an earlier ticket's), 0 if first in line else 1 (-1 after a last try)} when not;
-- an error (nothing written) when a ttl is not a valid integer.
-- Whatever was in the wake list predates this call and is dropped, so an element popped
-- after it was pushed after it: a hand-over that happened after this call ran.
"""
        + _CHECK_TTL
        + _check_ms("ticket ttl", "waiter_ttl", "ARGV[10]")
        + _check_ms("hand-over ttl", "hand_ttl", "ARGV[11]")
        + _GRANT
        + _line(_FIRST_LIVE, "KEYS[3]", "KEYS[4]")
        + _line(_FLAG_WAITERS, "KEYS[3]", "KEYS[4]")
        + """
local ticket = ARGV[9]
local t = redis.call('TIME')
local function out()
  redis.call('ZREM', KEYS[3], ticket)
  redis.call('HDEL', KEYS[4], ticket)
end
redis.call('DEL', KEYS[5])
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  local held = redis.call('HMGET', KEYS[1], 'token', 'fence')
  if held[1] == ARGV[1] then
    out()
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    redis.call('HSET', KEYS[1], 'ttl_ms', ttl_ms)
    return {tonumber(held[2]), 0, flag_waiters()}
  end
  if pttl == -1 then
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    pttl = ttl_ms
  end
end
local head = first_live(NOW_MS)
if pttl == -2 then
  if head == nil or head == ticket then
    out()
    local fence = grant(t, ARGV[1], ttl_ms, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
      ARGV[8])
    return {fence, 0, flag_waiters()}
  end
  pttl = 0
end
if ARGV[12] == '1' then
  out()
  return {0, pttl, -1}
end
if not redis.call('ZSCORE', KEYS[3], ticket) then
  -- Arrival order: strictly after the last ticket in line.
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  local order = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if last[2] and tonumber(last[2]) >= order then order = tonumber(last[2]) + 1 end
  redis.call('ZADD', KEYS[3], string.format('%d', order), ticket)
end
redis.call('HSET', KEYS[4], ticket, cmsgpack.pack(NOW_MS + waiter_ttl, ARGV[1], hand_ttl,
  ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]))
-- Both keys live as long as their longest-lived ticket, and go with it.
local keep = redis.call('PTTL', KEYS[3])
if keep < waiter_ttl then keep = waiter_ttl end
redis.call('PEXPIRE', KEYS[3], keep)
redis.call('PEXPIRE', KEYS[4], keep)
if pttl > 0 then redis.call('HSET', KEYS[1], 'waiters', 1) end
if head == nil or head == ticket then return {0, pttl, 0} end
return {0, pttl, 1}
"""
    )
    .replace("MAX_TTL_MS", str(MAX_TTL_MS))
    .replace("NOW_MS", _NOW_MS)
)

LEAVE = """
-- Leave the line: a waiting acquire that gave up or was interrupted.
-- KEYS[1] lock hash, KEYS[2] wait queue, KEYS[3] tickets, KEYS[4] this ticket's wake list
-- ARGV[1] owner token, ARGV[2] ticket
-- Returns 1 when a lock handed over to this waiter (which it never learned of) was given
-- back, else 0.
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

RENEW = (
    """
-- Renew a lock we own: *replace* its TTL (never add to it).
-- KEYS[1] lock hash
-- ARGV[1] owner token, ARGV[2] ttl in ms (integer, 1..MAX_TTL_MS)
-- Returns 1 renewed, 0 gone (expired/released), -1 held by another owner; an error (nothing
-- written) when the ttl is not a valid integer.
"""
    + _CHECK_TTL
    + """
local owner = redis.call('HGET', KEYS[1], 'token')
if owner == ARGV[1] then
  local t = redis.call('TIME')
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('HSET', KEYS[1], 'renewed_ms',
    tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 'ttl_ms', ttl_ms)
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
  return 1
end
if owner then return -1 end
return 0
"""
).replace("MAX_TTL_MS", str(MAX_TTL_MS))

RELEASE = (
    (
        """
-- Release a lock we own (compare-and-delete; never a blind DEL), or hand it over to the first
-- live ticket in line.
-- KEYS[1] lock hash; optional, one hash tag: KEYS[2] fence counter, KEYS[3] wait queue,
-- KEYS[4] tickets, KEYS[5] the wake list of ticket ARGV[2]
-- ARGV[1] owner token, ARGV[2] the ticket the caller expects first in line ('' if none known)
-- Returns 1 released, 0 gone (expired/released), -1 held by another owner. With KEYS[4] and
-- live tickets in line, the lock (ours or gone) goes to the first of them: written with its
-- token, its details and its hand-over ttl, and "fence next-ticket" pushed to its wake list,
-- where it blocks. That needs its wake list in KEYS: when the first live ticket is not ARGV[2]
-- (or KEYS[5] is missing), nothing is changed and that ticket is returned (a string), for the
-- caller to call again with its wake list.
"""
        + _GRANT
        + _line(_FIRST_LIVE, "KEYS[3]", "KEYS[4]")
        + _line(_FLAG_WAITERS, "KEYS[3]", "KEYS[4]")
        + """
local held = redis.call('HMGET', KEYS[1], 'token', 'waiters')
local owner = held[1]
if owner and owner ~= ARGV[1] then return -1 end
local code = 0
if owner then code = 1 end
-- Waiters flagged on our lock; or the lock is gone (it expired) and maybe some wait.
if KEYS[4] and (held[2] or (not owner and redis.call('EXISTS', KEYS[3]) == 1)) then
  local t = redis.call('TIME')
  local head, data = first_live(NOW_MS)
  if head then
    if head ~= ARGV[2] or not KEYS[5] then return head end
    redis.call('ZREM', KEYS[3], head)
    redis.call('HDEL', KEYS[4], head)
    local _, token, hand_ttl, host, pid, job_id, job_func, worker = cmsgpack.unpack(data)
    redis.call('DEL', KEYS[1])
    local fence = grant(t, token, hand_ttl, FENCE_COUNTER_TTL_MS, host, pid, job_id,
      job_func, worker)
    local after = flag_waiters()
    redis.call('DEL', KEYS[5])
    redis.call('LPUSH', KEYS[5], string.format('%d', fence) .. ' ' .. after)
    redis.call('PEXPIRE', KEYS[5], hand_ttl)
    return code
  end
end
if owner then redis.call('DEL', KEYS[1]) end
return code
"""
    )
    .replace("NOW_MS", _NOW_MS)
    .replace("FENCE_COUNTER_TTL_MS", str(FENCE_COUNTER_TTL_MS))
)


METRICS = """
-- Add buffered metric increments to the current time bucket and to the all-time totals.
-- KEYS[1] bucket hash, KEYS[2] totals hash (same {metrics} hash tag)
-- ARGV[1] bucket retention in seconds, then field, increment pairs
-- Returns the number of fields written.
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return (#ARGV - 1) / 2
"""


READ = """
-- Read a lock as one snapshot on its own server (Redis Cluster: on the node of its slot).
-- KEYS[1] lock hash
-- Returns {server seconds, microseconds (TIME), PTTL in ms, HGETALL's field, value list}.
-- Read-only.
local t = redis.call('TIME')
return {t[1], t[2], redis.call('PTTL', KEYS[1]), redis.call('HGETALL', KEYS[1])}
"""
