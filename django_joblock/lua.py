"""The Lua scripts, and the one place their return codes are given meaning.

Each script is atomic on the Redis server, touches only keys passed in KEYS (all sharing the
resource's hash tag, so they are Redis-Cluster-safe) and reads the server clock with ``TIME``.
Redis >= 5 replicates script *effects*, so calling ``TIME`` before a write is allowed.

Scripts are called by SHA (``EVALSHA``); :func:`run` and :func:`load_all` reload them after a
``NOSCRIPT`` (a Redis restart or ``SCRIPT FLUSH``).
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any

from redis.exceptions import NoScriptError

from . import conf
from .backend import execute, execute_many

# Last fence of a resource lives this long after its last acquire. The fence is also floored by
# the server clock, so a forgotten counter cannot make the next fence go backwards.
FENCE_COUNTER_TTL_MS = 86_400_000

# Largest TTL a script accepts (ms): the longest the settings and arguments allow.
MAX_TTL_MS = int(conf.MAX_TTL * 1000)

# Redis does not roll back a script's writes when a later command in it fails, so every script
# that writes checks its numeric arguments *first*: a bad TTL must fail before the lock hash is
# written, never between HSET and PEXPIRE (which would leave a lock that never expires).
_CHECK_TTL = """
local ttl_ms = tonumber(ARGV[2])
if not ttl_ms or ttl_ms ~= math.floor(ttl_ms) or ttl_ms < 1 or ttl_ms > MAX_TTL_MS then
  return redis.error_reply('ERR joblock: ttl in ms must be an integer in 1..MAX_TTL_MS, got '
    .. tostring(ARGV[2]))
end
""".replace("MAX_TTL_MS", str(MAX_TTL_MS))

ACQUIRE = (
    """
-- Acquire a lock if free.
-- KEYS[1] lock hash, KEYS[2] fence counter (same hash tag)
-- ARGV[1] owner token, ARGV[2] ttl in ms (integer, 1..MAX_TTL_MS), ARGV[3] fence counter ttl
-- in ms, ARGV[4] host, ARGV[5] pid, ARGV[6] RQ job id, ARGV[7] job function, ARGV[8] worker
-- Returns the fence (> 0) when acquired; when busy, -1 - (holder's PTTL in ms), i.e. <= -1;
-- an error (nothing written) when the ttl is not a valid integer.
-- (One integer rather than an array: the cheapest reply to parse on the hot path.)
-- Already ours (an earlier call with this token ran but its reply was lost): the same fence
-- again, and the TTL set afresh, so that retrying an acquire is safe.
-- fence = max(counter + 1, server time in microseconds): strictly increasing per resource even
-- after the counter is lost (expiry, eviction, FLUSHDB, restart without persistence), as long
-- as the Redis server clock does not step backwards.
"""
    + _CHECK_TTL
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
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local fence_s = string.format('%d', now_us)
-- Common case in one call: store the clock and read the old counter (SET ... GET, Redis 6.2+).
local last = tonumber(redis.call('SET', KEYS[2], fence_s, 'PX', ARGV[3], 'GET') or '0')
local fence = now_us
if last >= now_us then
  -- More than one acquisition within a microsecond, or the clock is behind the counter.
  fence = last + 1
  fence_s = string.format('%d', fence)
  redis.call('SET', KEYS[2], fence_s, 'PX', ARGV[3])
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence_s, 'ttl_ms', ttl_ms,
  'host', ARGV[4], 'pid', ARGV[5], 'job_id', ARGV[6], 'job_func', ARGV[7], 'worker', ARGV[8],
  'acquired_ms', now_ms, 'renewed_ms', now_ms, 'renewals', 0)
redis.call('PEXPIRE', KEYS[1], ttl_ms)
return fence
"""
).replace("MAX_TTL_MS", str(MAX_TTL_MS))

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

RELEASE = """
-- Release a lock we own (compare-and-delete; never a blind DEL).
-- KEYS[1] lock hash
-- ARGV[1] owner token
-- Returns 1 released, 0 gone (expired/released), -1 held by another owner.
local owner = redis.call('HGET', KEYS[1], 'token')
if owner == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
if owner then return -1 end
return 0
"""


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


class Outcome(enum.IntEnum):
    """Return codes of RENEW and RELEASE."""

    OK = 1
    GONE = 0
    OTHER_OWNER = -1

    @property
    def reason(self) -> str:
        return {1: "ok", 0: "expired", -1: "taken by another owner"}[self.value]


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


ACQUIRE_SHA = sha(ACQUIRE)
RENEW_SHA = sha(RENEW)
RELEASE_SHA = sha(RELEASE)
METRICS_SHA = sha(METRICS)
_SOURCES = {ACQUIRE_SHA: ACQUIRE, RENEW_SHA: RENEW, RELEASE_SHA: RELEASE, METRICS_SHA: METRICS}


def busy_pttl_ms(reply: int) -> int:
    """The holder's remaining TTL (ms) encoded in a negative ACQUIRE reply."""
    return -reply - 1


def load_all(client: Any) -> None:
    """Load every script into the server's script cache (after a restart or SCRIPT FLUSH)."""
    for source in _SOURCES.values():
        client.script_load(source)


def run_args(client: Any, command: list[Any]) -> Any:
    """Run a prepared ``["EVALSHA", sha, numkeys, ...]`` command, loading the script if needed."""
    try:
        return execute(client, *command)
    except NoScriptError:
        execute(client, "SCRIPT", "LOAD", _SOURCES[command[1]])
        return execute(client, *command)


def run(client: Any, script_sha: str, keys: list[str], args: list[Any]) -> Any:
    """``EVALSHA`` one script on the lean path, loading it if the server forgot it.

    A connection that fails mid-call is retried once (see :func:`backend.execute_packed`):
    every script here is safe to run twice (acquire recognises its own token, renew replaces
    the TTL, release compares the token; metrics may count an increment twice).
    """
    try:
        return execute(client, "EVALSHA", script_sha, len(keys), *keys, *args)
    except NoScriptError:
        execute(client, "SCRIPT", "LOAD", _SOURCES[script_sha])
        return execute(client, "EVALSHA", script_sha, len(keys), *keys, *args)


def release(client: Any, key: str, token: str, also: list[list[Any]]) -> tuple[Outcome, bool]:
    """Run RELEASE for ``token``, with the commands ``also`` in the same round trip.

    Returns the outcome and whether the round trip was sent twice (its connection failed after
    sending): then a GONE outcome may be this very release's first run. Raises the first
    error reply, or a connection error.
    """
    commands: list[list[Any]] = [["EVALSHA", RELEASE_SHA, 1, key, token], *also]
    replies = execute_many(client, commands)
    for index, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):  # Redis restarted: load and run it again
            replies[index] = run_args(client, commands[index])
        elif isinstance(reply, Exception):
            raise reply
    return Outcome(replies[0]), replies.retried
