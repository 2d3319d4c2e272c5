"""The lock's Lua scripts, each with a KEYS/ARGV/Returns header, and :class:`Outcome`.

Each script is atomic on the server, touches only the keys in its KEYS (one resource's keys,
under its hash tag: Redis-Cluster-safe) and reads the server clock with ``TIME`` (Redis >= 5
replicates script effects). Every script that writes checks its numeric arguments first: Redis
does not roll a script back, so a bad TTL must fail before the lock hash is written, never
between ``HSET`` and ``PEXPIRE`` (a lock without expiry).

Waiting in line (WAIT, LEAVE and RELEASE's hand-over; the protocol is told in
:mod:`.waiting`): waiters hold *tickets*, a sorted set in arrival order plus a hash of each
ticket's expiry (server ms) and the details its lock is written with. The next script that
finds an expired ticket first in line drops it.
"""

from __future__ import annotations

import enum

from .. import conf
from ..backend import Script

# The last fence of a resource lives this long after its last acquire. The fence is floored by
# the server clock too, so a forgotten counter cannot make the next fence go backwards.
FENCE_COUNTER_TTL_MS = 86_400_000
# Largest TTL a script accepts (ms): the longest the settings and arguments allow.
MAX_TTL_MS = int(conf.MAX_TTL * 1000)


class Outcome(enum.IntEnum):
    """Return codes of RENEW and RELEASE."""

    OK = 1
    GONE = 0
    OTHER_OWNER = -1

    @property
    def reason(self) -> str:
        return {1: "ok", 0: "expired", -1: "taken by another owner"}[self.value]


def _check_ms(name: str, variable: str, argument: str) -> str:
    """Lua that returns an error unless ``argument`` is an integer count of ms in range."""
    return f"""
local {variable} = tonumber({argument})
if not {variable} or {variable} ~= math.floor({variable}) or {variable} < 1
    or {variable} > {MAX_TTL_MS} then
  return redis.error_reply('ERR joblock: {name} in ms must be an integer in 1..{MAX_TTL_MS}, got '
    .. tostring({argument}))
end
"""


_CHECK_TTL = _check_ms("ttl", "ttl_ms", "ARGV[2]")
_NOW_MS = "local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(t[2] / 1000) end\n"

# The first live ticket in line and its packed details (nil: nobody in line; '' when 100 dead
# tickets were removed and the line is not known yet). Dead tickets found on the way go.
_FIRST_LIVE = """
local function first_live(queue, tickets, now)
  for _ = 1, 100 do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then return nil, nil end
    local data = redis.call('HGET', tickets, head)
    if data and cmsgpack.unpack(data) > now then return head, data end
    redis.call('ZREM', queue, head)
    redis.call('HDEL', tickets, head)
  end
  return '', nil
end
"""

# Someone waits: the first ticket in line (or ''); the lock hash ``key`` says so with its
# ``waiters`` field, which spares an uncontended release a look at the line.
_FLAG_WAITERS = """
local function flag_waiters(queue, key)
  local first = redis.call('ZRANGE', queue, 0, 0)[1]
  if not first then return '' end
  redis.call('HSET', key, 'waiters', 1)
  return first
end
"""

# Write the lock hash ``key`` for ``token`` with a new fence (KEYS[2]); returns the fence.
# ``limit``, the number of slots of a lock with several holders, is written when above 1.
# fence = max(counter + 1, server time in microseconds): strictly increasing per resource even
# after the counter is lost (expiry, eviction, FLUSHDB, a restart without persistence), as long
# as the server clock does not step backwards.
_GRANT = """
local function grant(key, t, token, ttl, fence_ttl, host, pid, job_id, job_func, worker, limit)
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local fence_s = string.format('%d', now_us)
  local last = tonumber(redis.call('SET', KEYS[2], fence_s, 'PX', fence_ttl, 'GET') or '0')
  if last >= now_us then
    fence_s = string.format('%d', last + 1)
    redis.call('SET', KEYS[2], fence_s, 'PX', fence_ttl)
  end
  redis.call('HSET', key, 'token', token, 'fence', fence_s, 'ttl_ms', ttl,
    'host', host, 'pid', pid, 'job_id', job_id, 'job_func', job_func, 'worker', worker,
    'acquired_ms', now_ms(t), 'renewed_ms', now_ms(t), 'renewals', 0)
  if limit and limit > 1 then redis.call('HSET', key, 'limit', limit) end
  redis.call('PEXPIRE', key, ttl)
  return tonumber(fence_s)
end
"""

ACQUIRE = Script(
    """
-- Acquire a lock if it is free (one try).
-- KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] wait queue, KEYS[4] tickets; optional
-- (one server, not Cluster): KEYS[5] active-lock index of the family, KEYS[6] families set
-- ARGV[1] owner token, ARGV[2] ttl in ms (integer, 1..MAX), ARGV[3] fence counter ttl in ms,
-- ARGV[4] host, ARGV[5] pid, ARGV[6] RQ job id, ARGV[7] job function, ARGV[8] worker; with
-- KEYS[5]: ARGV[9] index score (expiry, Unix ms), ARGV[10] index member, ARGV[11] family
-- Returns the fence (> 0) when acquired (and indexed, given KEYS[5]); when busy -1 -
-- (holder's PTTL in ms), so <= -1 (-1 also when the lock is free but live tickets wait: a
-- newcomer never goes before them); an error, nothing written, for a bad ttl. Already ours
-- (a retry whose first reply was lost): the same fence, the TTL set afresh.
"""
    + _CHECK_TTL
    + _NOW_MS
    + _GRANT
    + _FIRST_LIVE
    + """
local function indexed(fence)
  if KEYS[5] then
    redis.call('ZADD', KEYS[5], ARGV[9], ARGV[10])
    redis.call('SADD', KEYS[6], ARGV[11])
  end
  return fence
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl ~= -2 then
  local held = redis.call('HMGET', KEYS[1], 'token', 'fence')
  if held[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    return indexed(tonumber(held[2]))
  end
  if pttl == -1 then
    -- A lock without expiry can only be left by a bug or a hand-made key: give it one.
    redis.call('PEXPIRE', KEYS[1], ttl_ms)
    pttl = ttl_ms
  end
  return -1 - math.max(pttl, 0)
end
local t = redis.call('TIME')
if redis.call('EXISTS', KEYS[3]) == 1 and first_live(KEYS[3], KEYS[4], now_ms(t)) ~= nil then
  return -1
end
return indexed(grant(KEYS[1], t, ARGV[1], ttl_ms, ARGV[3], ARGV[4], ARGV[5], ARGV[6],
  ARGV[7], ARGV[8]))
"""
)

WAIT = Script(
    """
-- Wait in line: take the lock if it is free and nobody live is ahead, else take or refresh
-- this waiter's ticket (see django_joblock/locks/waiting.py).
-- KEYS[1..4] as ACQUIRE, KEYS[5] this ticket's wake list; for a lock with a limit of N
-- holders, KEYS[6..N+4] the lock hashes of slots 1..N-1 (KEYS[1] is slot 0's); optional (one
-- server, not Cluster), after them: the active-lock index of the family, the families set
-- ARGV[1..8] as ACQUIRE, ARGV[9] ticket, ARGV[10] ticket ttl in ms, ARGV[11] ttl in ms of a
-- lock handed over to this ticket by a release, ARGV[12] '1' for the last try (leave the line
-- when not acquired), ARGV[13] N - 1 (how many slot keys follow KEYS[5]; default 0); with
-- the index keys: ARGV[14] index score (expiry, Unix ms), ARGV[15] index member of slot 0,
-- ARGV[16] the start of the member of another slot (its number follows), ARGV[17] family
-- Returns {fence, 0, first ticket in line or '', slot} when acquired (also when it already
-- was ours: handed over, or a retry; the TTL set afresh; indexed, given the index keys);
-- {0, PTTL in ms of the holder that expires first (0: a slot is free but earlier tickets'),
-- 0 if next to be served else 1 (-1 after a last try)} when not; an error, nothing written,
-- for a bad ttl. With several slots a ticket takes a free one when fewer live tickets are
-- ahead of it than slots are free. The wake list is emptied: what is popped after this call
-- was pushed by a hand-over that ran after it.
"""
    + _CHECK_TTL
    + _check_ms("ticket ttl", "waiter_ttl", "ARGV[10]")
    + _check_ms("hand-over ttl", "hand_ttl", "ARGV[11]")
    + _NOW_MS
    + _GRANT
    + _FIRST_LIVE
    + _FLAG_WAITERS
    + """
local ticket = ARGV[9]
local t = redis.call('TIME')
local function out()
  redis.call('ZREM', KEYS[3], ticket)
  redis.call('HDEL', KEYS[4], ticket)
end
-- The lock's slots: KEYS[1], then KEYS[6..] for a lock with a limit of several holders.
local extra = tonumber(ARGV[13]) or 0
local slots = {KEYS[1]}
for i = 6, 5 + extra do slots[#slots + 1] = KEYS[i] end
-- The holding of slots[i] in the active-lock index, when its keys were given.
local function indexed(fence, i)
  if KEYS[6 + extra] then
    local member = ARGV[15]
    if i > 1 then member = ARGV[16] .. (i - 1) end
    redis.call('ZADD', KEYS[6 + extra], ARGV[14], member)
    redis.call('SADD', KEYS[7 + extra], ARGV[17])
  end
  return fence
end
redis.call('DEL', KEYS[5])
local free, held = {}, {}
local pttl = -2  -- the soonest a held slot expires (ms)
for i, key in ipairs(slots) do
  local left = redis.call('PTTL', key)
  if left == -2 then
    free[#free + 1] = i
  else
    local holder = redis.call('HMGET', key, 'token', 'fence')
    if holder[1] == ARGV[1] then
      out()
      redis.call('PEXPIRE', key, ttl_ms)
      redis.call('HSET', key, 'ttl_ms', ttl_ms)
      return {indexed(tonumber(holder[2]), i), 0, flag_waiters(KEYS[3], key), i - 1}
    end
    if left == -1 then
      redis.call('PEXPIRE', key, ttl_ms)
      left = ttl_ms
    end
    held[#held + 1] = key
    if pttl == -2 or left < pttl then pttl = left end
  end
end
local head = first_live(KEYS[3], KEYS[4], now_ms(t))
-- Live tickets ahead of this one (with one slot, 0 or 1: only the first in line may take it).
local ahead = 1
if head == nil or head == ticket then
  ahead = 0
elseif #slots > 1 and head ~= '' then
  ahead = redis.call('ZRANK', KEYS[3], ticket) or redis.call('ZCARD', KEYS[3])
end
if #free > ahead then
  out()
  local key = slots[free[1]]
  local fence = grant(key, t, ARGV[1], ttl_ms, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7],
    ARGV[8], #slots)
  return {indexed(fence, free[1]), 0, flag_waiters(KEYS[3], key), free[1] - 1}
end
if #free > 0 then pttl = 0 end
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
redis.call('HSET', KEYS[4], ticket, cmsgpack.pack(now_ms(t) + waiter_ttl, ARGV[1], hand_ttl,
  ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], #slots))
-- Both keys live as long as their longest-lived ticket, and go with it.
local keep = math.max(redis.call('PTTL', KEYS[3]), waiter_ttl)
redis.call('PEXPIRE', KEYS[3], keep)
redis.call('PEXPIRE', KEYS[4], keep)
for _, key in ipairs(held) do redis.call('HSET', key, 'waiters', 1) end
-- Next to be served: no free slot waits for an earlier ticket, and one of the held slots
-- would be this ticket's if it expired.
if #free == 0 and ahead < #slots then return {0, pttl, 0} end
return {0, pttl, 1}
"""
)

LEAVE = Script(
    """
-- Leave the line: a waiting acquire that gave up or was interrupted.
-- KEYS[1] lock hash, KEYS[2] wait queue, KEYS[3] tickets, KEYS[4] this ticket's wake list;
-- for a lock with a limit, KEYS[5..] the lock hashes of its other slots
-- ARGV[1] owner token, ARGV[2] ticket
-- Returns 1 when a lock handed over to this waiter (which it never learned of) was given
-- back, else 0.
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[4])
local slots = {KEYS[1]}
for i = 5, #KEYS do slots[#slots + 1] = KEYS[i] end
for _, key in ipairs(slots) do
  if redis.call('HGET', key, 'token') == ARGV[1] then
    redis.call('DEL', key)
    return 1
  end
end
return 0
"""
)

RENEW = Script(
    """
-- Renew a lock we own: *replace* its TTL (never add to it).
-- KEYS[1] lock hash; optional (one server, not Cluster): KEYS[2] active-lock index of the
-- family, KEYS[3] families set
-- ARGV[1] owner token, ARGV[2] ttl in ms (integer, 1..MAX); with KEYS[2]: ARGV[3] index score
-- (expiry, Unix ms), ARGV[4] index member, ARGV[5] family
-- Returns 1 renewed (and its index entry written, given KEYS[2]: only then, so that a renewal
-- arriving after the release never puts a released holding's entry back), 0 gone
-- (expired/released), -1 held by another owner; an error, nothing written, for a bad ttl.
"""
    + _CHECK_TTL
    + _NOW_MS
    + """
local owner = redis.call('HGET', KEYS[1], 'token')
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('HSET', KEYS[1], 'renewed_ms', now_ms(redis.call('TIME')), 'ttl_ms', ttl_ms)
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
  if KEYS[2] then
    redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
    redis.call('SADD', KEYS[3], ARGV[5])
  end
  return 1
end
if owner then return -1 end
return 0
"""
)

RELEASE = Script(
    """
-- Release a lock we own (compare-and-delete, never a blind DEL), or hand it over to the first
-- live ticket in line.
-- KEYS[1] lock hash; optional, in this order: KEYS[2] fence counter, KEYS[3] wait queue,
-- KEYS[4] tickets (without them the line is not looked at), KEYS[5] the wake list of ARGV[2],
-- KEYS[6] (one server, not Cluster) the active-lock index of the family
-- ARGV[1] owner token, ARGV[2] the ticket the caller expects first in line ('' if none known),
-- with KEYS[6]: ARGV[3] this holding's index member, removed whatever the outcome
-- Returns 1 released, 0 gone (expired/released), -1 held by another owner. With live tickets
-- in line the lock (ours, or gone) goes to the first of them: written with its token,
-- details and hand-over ttl, and "fence next-ticket lock-hash" pushed to its wake list. That
-- needs the wake list in KEYS: when the first live ticket is not ARGV[2] (or KEYS[5] is
-- missing), nothing is changed and that ticket is returned (a string), for the caller to ask
-- again. KEYS[1] may be any slot of a lock with a limit: the line is the resource's.
"""
    + _NOW_MS
    + _GRANT
    + _FIRST_LIVE
    + _FLAG_WAITERS
    + f"""
if KEYS[6] then redis.call('ZREM', KEYS[6], ARGV[3]) end
local held = redis.call('HMGET', KEYS[1], 'token', 'waiters')
local owner = held[1]
if owner and owner ~= ARGV[1] then return -1 end
local code = 0
if owner then code = 1 end
if KEYS[4] and (held[2] or (not owner and redis.call('EXISTS', KEYS[3]) == 1)) then
  local t = redis.call('TIME')
  local head, data = first_live(KEYS[3], KEYS[4], now_ms(t))
  if data then  -- not when 100 dead tickets left the line unknown: its first notices in time
    if head ~= ARGV[2] or not KEYS[5] then return head end
    local _, token, hand_ttl, host, pid, job_id, job_func, worker, limit = cmsgpack.unpack(data)
    -- A ticket takes only a slot its lock has (slot 0 for a plain lock); the slot is the
    -- suffix of the lock hash's key (locks/keys.py: P:{{resource}}:lock:<slot>).
    local slot = tonumber(string.match(KEYS[1], ':lock:(%d+)$')) or 0
    if slot >= (limit or 1) then
      if owner then redis.call('DEL', KEYS[1]) end
      return code
    end
    redis.call('ZREM', KEYS[3], head)
    redis.call('HDEL', KEYS[4], head)
    redis.call('DEL', KEYS[1])
    local fence = grant(KEYS[1], t, token, hand_ttl, {FENCE_COUNTER_TTL_MS}, host, pid,
      job_id, job_func, worker, limit)
    local after = flag_waiters(KEYS[3], KEYS[1])
    redis.call('DEL', KEYS[5])
    redis.call('LPUSH', KEYS[5], string.format('%d', fence) .. ' ' .. after .. ' ' .. KEYS[1])
    redis.call('PEXPIRE', KEYS[5], hand_ttl)
    return code
  end
end
if owner then redis.call('DEL', KEYS[1]) end
return code
"""
)

READ = Script(
    """
-- Read a lock as one snapshot on its own server (Redis Cluster: the node of its slot).
-- KEYS[1] lock hash
-- Returns {server seconds, microseconds (TIME), PTTL in ms, HGETALL's field, value list}.
-- Read-only.
local t = redis.call('TIME')
return {t[1], t[2], redis.call('PTTL', KEYS[1]), redis.call('HGETALL', KEYS[1])}
"""
)
